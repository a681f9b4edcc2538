# =============================================================================================
# Build: load_inline at import, under a name that hashes the source, the flags and the environment.
# (src/common/build.py, inlined by tools/bundle.py into both kernel files after their imports: each file
# stands alone.)
# =============================================================================================
def _gencode_flags():
    """nvcc -gencode flags: the architectures PyTorch would build for (TORCH_CUDA_ARCH_LIST as PyTorch
    reads it or, none set or "native", the visible GPUs' compute capabilities capped at the newest this
    PyTorch supports, the last with PTX only for a GPU above that cap), but with sm_90a code for 9.0: wgmma
    and setmaxnreg exist only there, and sm_90a code runs on compute capability 9.0 devices as sm_90 code
    does; "9.0+PTX" keeps its portable compute_90 PTX beside it. With no GPU to detect and no list (a CI
    machine, a laptop; PyTorch alone would fail there): 9.0, the flags an H100 / H200 picks, so that a
    KernelBench precompile on a CPU machine is found again by the GPU evaluation. Flags naming an arch
    replace PyTorch's own; TORCH_CUDA_ARCH_LIST itself is not changed. Returns [] for lists it cannot parse
    (names such as "Hopper"): PyTorch then builds as usual, without sm_90a (no Hopper kernels)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if env and env != "native":
        archs = [a for a in env.replace(" ", ";").split(";") if a]
    elif not torch.cuda.is_available():
        archs = ["9.0"]
    else:
        sms = [int("".join(re.findall(r"\d+", a.split("_")[1]))) for a in torch.cuda.get_arch_list() if "sm_" in a]
        newest = max((sm // 10, sm % 10) for sm in sms)
        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        archs = sorted({"%d.%d" % min(newest, cap) for cap in caps})
        if any(cap > newest for cap in caps):  # a GPU newer than this PyTorch's list: PTX for it
            archs[-1] += "+PTX"
    flags = []
    for a in archs:
        m = re.fullmatch(r"(\d+)\.(\d+)(a?)(\+PTX)?", a)
        if m is None:
            return []
        num, suffix = m.group(1) + m.group(2), m.group(3)
        if num == "90":
            suffix = "a"
        flags.append(f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}")
        if m.group(4):
            ptx = num if num == "90" else num + suffix
            flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    return list(dict.fromkeys(flags))


def _nvcc_flags(sm90a_define, verbose):
    """nvcc's flags: -O3; -lineinfo (source lines for compute-sanitizer and ncu, naming src/ through the
    bundle's #line directives; no instruction changes); _gencode_flags(); sm90a_define (-DCM_SM90A,
    -DOPM_SM90A: the host side's word that the build has sm_90a code) exactly when it does; -Xptxas -v
    (registers, stack, spills) when verbose."""
    gencode = _gencode_flags()
    return (["-O3", "-lineinfo"] + gencode + ([sm90a_define] if any("code=sm_90a" in f for f in gencode) else [])
            + (["-Xptxas", "-v"] if verbose else []))


def _build_environment():
    """What besides the source and the flags shapes the build: the build root (TORCH_EXTENSIONS_DIR as PyTorch
    reads it; unset, its default root), the CUDA toolkit PyTorch found (its include and library paths) and
    PyTorch itself (its version and headers). All of it goes into the extension's name, so that each
    environment keeps its own build: under one name PyTorch's loader renames the extension (name_v1, ...) when
    a process loads it from a second build directory, and ninja rebuilds one toolkit's build over another's in
    silence (a failed link there deletes it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return "\n".join(["default" if root is None else os.path.abspath(root), str(torch.utils.cpp_extension.CUDA_HOME),
                      torch.__version__, os.path.dirname(torch.__file__)])


def _hashed_name(prefix, source, flags):
    """prefix + a hash of the source, the flags and _build_environment(): an edit, a flag or another
    environment builds anew instead of loading a stale extension."""
    key = source + " ".join(flags) + "\n" + _build_environment()
    return prefix + hashlib.sha256(key.encode()).hexdigest()[:12]


def _cached_library(name):
    """The library of `name` where a build left it (its build directory as PyTorch names it, PyTorch's private
    function: without it, None), else None."""
    build_directory = getattr(torch.utils.cpp_extension, "_get_build_directory", None)
    if build_directory is None:
        return None
    d = build_directory(name, verbose=False)
    for ext in (".so", ".pyd"):
        if os.path.isfile(os.path.join(d, name + ext)):
            return os.path.join(d, name + ext)
    return None


def _load(name, what, eta, cuda_source, cuda_flags, verbose):
    """The extension `name`: a built one imported from its library (the name hashes source, flags and
    environment, so a library under it is this source's build), else load_inline of cuda_source (a failed build
    raises with the compiler's output in its text), saying on stderr that it compiles: what CUDA extension, about
    eta on 2 cores. load_inline on a built extension would run ninja, which rebuilds it in silence: nvcc's
    dependency file lists the src/ files the #line directives name, absent from the build directory, and ninja
    takes a missing dependency for a changed one."""
    library = _cached_library(name)
    if library is not None:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    print(f"building {what} CUDA extension ({name}): {eta} on 2 cores, once (cached afterwards)",
          file=sys.stderr, flush=True)
    return load_inline(name=name, cpp_sources="", cuda_sources=cuda_source, extra_cuda_cflags=cuda_flags,
                       verbose=verbose)


def _rows_per_chunk(row_bytes, n, chunk_bytes):
    """Rows of a chunk: as many as fit in chunk_bytes at row_bytes each, at least 1, at most n."""
    return max(1, min(n, int(chunk_bytes) // max(1, int(row_bytes))))
