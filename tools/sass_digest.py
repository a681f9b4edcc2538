"""SASS digests of a kernel file's CUDA kernels: proof that a refactor left the machine code alone.

    python tools/sass_digest.py contact_map.py [--arch "8.0;9.0"] [--json OUT.json]
                                               [--compare BEFORE.json] [--sass-dir DIR]

Builds the file exactly as an import does (its own `load_inline` call and nvcc flags, with
TORCH_CUDA_ARCH_LIST set to --arch, default "8.0;9.0": the files build 9.0 as sm_90a) into a
fresh extension directory, then reads the built library back with `cuobjdump`. Per kernel and
architecture it prints:

    arch   instructions   digest   registers   stack   local   LDL/STL   HGMMA   HMMA   name

The digest is a SHA-1 of the kernel's SASS instructions with register numbers normalised (R12 -> R,
UR4 -> UR, P3 -> P, UP1 -> UP, B2 -> B) and addresses dropped: two builds whose kernels have the same
digest run the same instructions in the same order, whatever registers the allocator picked. LDL /
STL count local-memory loads and stores (spills or a stack array: a kernel that is done has none).

--compare matches kernels by (arch, demangled name); a kernel only in one build is matched by digest
to a renamed one where it can be. It prints one line per kernel and exits 1 if any kept kernel's
digest differs or a kernel vanished without a renamed twin; --sass-dir writes each kernel's
normalised SASS as a text file, to diff when a digest differs. Needs nvcc and cuobjdump (CUDA_HOME,
PATH or the copy in Triton's package), no GPU. A cold build for two architectures takes 3-5 minutes per file on
2 cores.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_REG_RULES = [(re.compile(r"(?<![.\w])UR\d+\b"), "UR"), (re.compile(r"(?<![.\w])R\d+\b"), "R"),
              (re.compile(r"(?<![.\w])UP\d+\b"), "UP"), (re.compile(r"(?<![.\w])P\d+\b"), "P"),
              (re.compile(r"(?<![.\w])B\d+\b"), "B")]


def _tool(name):
    """CUDA_HOME/bin/NAME, else NAME on PATH, else the copy that Triton's package carries (a toolkit
    without the binary utilities has nvcc but no cuobjdump)."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates = [os.path.join(home, "bin", name), shutil.which(name)]
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        candidates.append(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", name))
    for path in candidates:
        if path and os.path.exists(path):
            return path
    sys.exit(f"sass_digest: no {name} found (CUDA_HOME/bin, PATH, triton/backends/nvidia/bin)")


def build(path, arch):
    """Import the kernel file with TORCH_CUDA_ARCH_LIST=arch into a fresh extension directory;
    returns the path of the built extension library."""
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="sass_digest_")
    spec = importlib.util.spec_from_file_location("_sass_digest_target", os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._ext.__file__


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def normalise(instr):
    for rule, repl in _REG_RULES:
        instr = rule.sub(repl, instr)
    return " ".join(instr.split())


def read_sass(so):
    """{(arch, mangled name): [normalised instructions]} from `cuobjdump -sass`."""
    text = subprocess.run([_tool("cuobjdump"), "-sass", so], capture_output=True, text=True, check=True).stdout
    kernels, arch, current = {}, None, None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("arch = "):
            arch = s.split("=", 1)[1].strip()
        elif s.startswith("Function : "):
            current = kernels.setdefault((arch, s.split(":", 1)[1].strip()), [])
        elif current is not None:
            m = _INSTR.search(s)
            if m:
                current.append(normalise(m.group(1)))
    return kernels


def read_resources(so):
    """{(arch, mangled name): {"REG": .., "STACK": .., "LOCAL": .., "SHARED": ..}} from -res-usage."""
    text = subprocess.run([_tool("cuobjdump"), "-res-usage", so], capture_output=True, text=True,
                          check=True).stdout
    res, arch, name = {}, None, None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("arch = "):
            arch = s.split("=", 1)[1].strip()
        elif s.startswith("Function ") and s.endswith(":"):
            name = s[len("Function "):-1]
        elif name is not None and s.startswith("REG:"):
            fields = dict(re.findall(r"(\w+):(\d+)", s))
            res[(arch, name)] = {k: int(fields.get(k, 0)) for k in ("REG", "STACK", "LOCAL", "SHARED")}
            name = None
    return res


def digest_library(so):
    sass, res = read_sass(so), read_resources(so)
    keys = sorted(sass, key=lambda k: (str(k[0]), k[1]))
    names = demangle([k[1] for k in keys])
    rows = []
    for (arch, mangled), name in zip(keys, names):
        ins = sass[(arch, mangled)]
        ops = [i.split()[0].split(".")[0] if not i.startswith("@") else i.split()[1].split(".")[0] for i in ins]
        r = res.get((arch, mangled), {})
        rows.append({
            "arch": arch, "name": name, "mangled": mangled, "instructions": len(ins),
            "digest": hashlib.sha1("\n".join(ins).encode()).hexdigest()[:16],
            "registers": r.get("REG"), "stack": r.get("STACK"), "local": r.get("LOCAL"),
            "ldl_stl": sum(op in ("LDL", "STL") for op in ops), "hgmma": ops.count("HGMMA"),
            "hmma": ops.count("HMMA"), "sass": ins,
        })
    return rows


def print_rows(rows):
    print(f"{'arch':7} {'instr':>6} {'digest':16} {'reg':>4} {'stack':>5} {'local':>5} {'LDL/STL':>7} "
          f"{'HGMMA':>5} {'HMMA':>5}  name")
    for r in rows:
        print(f"{str(r['arch']):7} {r['instructions']:6d} {r['digest']:16} {r['registers'] or 0:4d} {r['stack'] or 0:5d} "
              f"{r['local'] or 0:5d} {r['ldl_stl']:7d} {r['hgmma']:5d} {r['hmma']:5d}  {r['name']}")


def compare(before, after):
    """Print the kernel-by-kernel comparison; returns True when every kernel is accounted for."""
    b = {(r["arch"], r["name"]): r for r in before}
    a = {(r["arch"], r["name"]): r for r in after}
    ok = True
    only_a = {k: r for k, r in a.items() if k not in b}
    print("\ncomparison with the earlier build (arch, kernel):")
    for k, rb in sorted(b.items()):
        ra = a.get(k)
        if ra is not None:
            same = ra["digest"] == rb["digest"]
            ok &= same
            print(f"  {'identical' if same else 'DIFFERS  '}  {k[0]}  {k[1]}"
                  + ("" if same else f"  ({rb['instructions']} -> {ra['instructions']} instructions)"))
            continue
        twins = [ka for ka, r in only_a.items() if ka[0] == k[0] and r["digest"] == rb["digest"]]
        if twins:
            print(f"  renamed    {k[0]}  {k[1]}\n             -> {twins[0][1]}")
            only_a.pop(twins[0])
        else:
            print(f"  removed    {k[0]}  {k[1]}")
    for k in sorted(only_a):
        print(f"  new        {k[0]}  {k[1]}")
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="kernel file (contact_map.py, outer_product_mean.py)")
    p.add_argument("--arch", default="8.0;9.0", help='TORCH_CUDA_ARCH_LIST for the build (default "8.0;9.0")')
    p.add_argument("--so", help="read an already built extension library instead of building")
    p.add_argument("--json", help="write the digests (with each kernel's normalised SASS) to this file")
    p.add_argument("--compare", help="an earlier --json output to compare with")
    p.add_argument("--sass-dir", help="write each kernel's normalised SASS here, one file per kernel")
    args = p.parse_args(argv)

    so = args.so or build(args.file, args.arch)
    rows = digest_library(so)
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"file": args.file, "arch": args.arch, "kernels": rows}, f, indent=1)
    if args.sass_dir:
        os.makedirs(args.sass_dir, exist_ok=True)
        for i, r in enumerate(rows):
            with open(os.path.join(args.sass_dir, f"{r['arch']}_{i:03d}.sass"), "w") as f:
                f.write(r["name"] + "\n" + "\n".join(r["sass"]) + "\n")
    spills = [r for r in rows if r["ldl_stl"] or r["stack"]]
    for r in spills:
        print(f"local memory: {r['arch']} {r['name']}: {r['ldl_stl']} LDL/STL, {r['stack']} bytes of stack")
    if args.compare:
        with open(args.compare) as f:
            if not compare(json.load(f)["kernels"], rows):
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
