"""The kernel files under KernelBench's pipeline (ScalingIntelligence/KernelBench, src/kernelbench).

* Static rules: `kernel_static_checker.validate_kernel_static(code, backend="cuda", precision=...)`
  at commit 423217d. Its strict checks reject a source with `try:` / `except`, the word `pass`, a
  tensor subclass, threading or reassigned timing functions anywhere outside `#` and `//` comments
  (docstrings and strings count); its warnings flag `torch.nn.<compute layer>`, torch compute ops
  (`torch.matmul(`, `F.relu`, ...), CUDA streams and, for fp32, casts to fp16. The rules below restate
  those checks (same comment stripping: a line is cut at its first `#` and at its first `//`).
* Load path: `load_custom_model` prepends `os.environ['TORCH_EXTENSIONS_DIR'] = build_dir` to the
  file's text and `exec`s it in a fresh dict (no `__file__`, no module name); `build_compile_cache`
  does that on a CPU machine first, and the GPU evaluation then loads from the same directory.
"""
import os
import re

import pytest
import torch
import torch.utils.cpp_extension

KERNEL_FILES = ("contact_map.py", "outer_product_mean.py")

_STRICT = {
    "try/except fallback": [r"\btry\s*:", r"\bexcept\s*:", r"\bexcept\s+\w+"],
    "pass statement": [r"\bpass\b"],
    "timing monkey patch": [r"torch\.cuda\.Event\.record\s*=", r"torch\.cuda\.Event\.elapsed_time\s*=",
                            r"torch\.cuda\.synchronize\s*=", r"torch\.cuda\.Event\s*=", r"time\.perf_counter\s*=",
                            r"time\.time\s*="],
    "threading": [r"threading\.Thread\s*\(", r"import\s+threading", r"from\s+threading\s+import",
                  r"multiprocessing\.(Process|Pool|Manager|Queue|Pipe)", r"import\s+multiprocessing",
                  r"concurrent\.futures", r"ThreadPoolExecutor", r"ProcessPoolExecutor"],
    "lazy tensor": [r"_make_subclass", r"class\s+\w+.*\(torch\.Tensor\)", r"class\s+\w+.*\(Tensor\)",
                    r"torch\.Tensor\.__new__"],
}
_TORCH_OPS = (
    "torch.mm torch.bmm torch.matmul torch.einsum torch.conv1d torch.conv2d torch.conv3d torch.conv "
    "torch.conv_transpose1d torch.conv_transpose2d torch.conv_transpose3d torch.avg_pool1d torch.avg_pool2d "
    "torch.avg_pool3d torch.max_pool1d torch.max_pool2d torch.max_pool3d torch.adaptive_avg_pool1d "
    "torch.adaptive_avg_pool2d torch.adaptive_avg_pool3d torch.adaptive_max_pool1d torch.adaptive_max_pool2d "
    "torch.adaptive_max_pool3d torch.relu torch.hardtanh torch.elu torch.selu torch.leaky_relu torch.gelu "
    "torch.softsign torch.softplus torch.softmax torch.log_softmax torch.tanh torch.sigmoid torch.hardsigmoid "
    "torch.silu torch.mish torch.batch_norm torch.group_norm torch.layer_norm torch.instance_norm "
    "torch.rms_norm torch.normalize torch.linear torch.cross_entropy torch.kl_div torch.mse_loss "
    "torch.huber_loss torch.triplet_margin_loss torch.cosine_similarity torch.logsumexp torch.clamp "
    "torch.dropout").split()
_WARN = {
    "torch.nn compute layer": [r"torch\.nn\.(?!(Module|parameter|Parameter|ParameterList|ParameterDict|ModuleList"
                               r"|ModuleDict|init)\b)"],
    "torch compute op": [r"\b(" + "|".join(re.escape(op) for op in _TORCH_OPS) + r")(?=\s*\(|\s|$)",
                         r"torch\.nn\.functional\.\w+", r"\bnn\.functional\.\w+",
                         r"\bF\.(conv|linear|relu|gelu|softmax|batch_norm|layer_norm|dropout|max_pool|avg_pool)"],
    "CUDA streams": [r"torch\.cuda\.Stream\s*\(", r"cuda\.Stream\s*\(", r"with\s+torch\.cuda\.stream",
                     r"\.wait_stream\s*\(", r"\.record_stream\s*\("],
}
_FP32_DOWNGRADE = [r"__float2half(_rn)?\s*\(", r"\(\s*__half\s*\)\s*[\w\->\.]+", r"static_cast\s*<\s*(__half|half)\s*>\s*\(",
                   r"\.half\s*\(", r"\.float16\s*\(", r"\.to\s*\(\s*torch\.(float16|half)\b",
                   r"\.to\s*\(\s*dtype\s*=\s*torch\.(float16|half)\b"]


def strip_comments(code):
    """The checker's comment stripping: each line cut at its first '#', then at its first '//'."""
    lines = []
    for line in code.split("\n"):
        line = line.split("#", 1)[0]
        lines.append(line.split("//", 1)[0])
    return "\n".join(lines)


def static_findings(code, precision):
    """(errors, warnings): the names of the rules `code` breaks, as KernelBench would report them."""
    code = strip_comments(code)
    errors = [name for name, pats in _STRICT.items() if any(re.search(p, code) for p in pats)]
    if "__global__" not in code or not any(p in code for p in ("load_inline", "cpp_extension")):
        errors.append("no CUDA kernel compiled inline")
    warnings = [name for name, pats in _WARN.items() if any(re.search(p, code) for p in pats)]
    if precision == "fp32" and any(re.search(p, code) for p in _FP32_DOWNGRADE):
        warnings.append("fp32 -> fp16 downgrade")
    return errors, warnings


def test_rules_fire_on_what_they_forbid():
    """Each rule catches its pattern in a docstring or code, and a comment hides it."""
    kernel = 'load_inline(cuda_sources="__global__ void k() {}")\n'
    assert static_findings(kernel, "fp32") == ([], [])
    assert "pass statement" in static_findings(kernel + '"""a second pass"""\n', "fp32")[0]
    assert static_findings(kernel + "x = 1  # a second pass\n", "fp32") == ([], [])
    assert "try/except fallback" in static_findings(kernel + "try:\n    f()\nexcept Exception:\n    g()\n", "fp32")[0]
    assert "torch compute op" in static_findings(kernel + "y = torch.matmul(a, b)\n", "fp32")[1]
    assert "torch compute op" in static_findings(kernel + "y = F.relu(a)\n", "bf16")[1]
    assert static_findings(kernel + "y = (a @ b).relu()\n", "fp32") == ([], [])
    assert "torch.nn compute layer" in static_findings(kernel + "m = torch.nn.Linear(2, 2)\n", "fp32")[1]
    assert "fp32 -> fp16 downgrade" in static_findings(kernel + "y = x.half()\n", "fp32")[1]
    assert static_findings(kernel + "y = x.half()\n", "fp16") == ([], [])
    assert "no CUDA kernel compiled inline" in static_findings("x = 1\n", "fp32")[0]


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("path", KERNEL_FILES)
def test_kernel_file_passes_static_checker(repo_root, path, precision):
    with open(os.path.join(repo_root, path)) as f:
        errors, warnings = static_findings(f.read(), precision)
    assert errors == [], f"{path}: KernelBench's static checker rejects it ({precision}): {errors}"
    assert warnings == [], f"{path}: KernelBench's static checker warns ({precision}): {warnings}"


def _exec_like_kernelbench(repo_root, path, build_dir):
    """load_custom_model's steps: prepend the TORCH_EXTENSIONS_DIR line, exec the text in a new dict."""
    with open(os.path.join(repo_root, path)) as f:
        src = f.read()
    src = "import os\n" f"os.environ['TORCH_EXTENSIONS_DIR'] = '{build_dir}'\n" + src
    context = {}
    exec(compile(src, "<string>", "exec"), context)
    return context["ModelNew"]


def _reference(repo_root, load_module, path):
    return load_module(os.path.join(repo_root, "reference", path), "kb_ref_" + path[:-3])


@pytest.mark.parametrize("path", KERNEL_FILES)
def test_kernelbench_load_path(repo_root, load_module, kernel_module, path, tmp_path, monkeypatch, capfd):
    """Precompile into a build directory as build_compile_cache does, load again from it without a
    rebuild, under the directory's own unversioned name (a later load from the default directory keeps
    its name too), construct ModelNew with KernelBench's seeding, take the reference's weights, and
    reject a CPU input with a clear error."""
    first = kernel_module(path, "kb_build_check_" + path[:-3])  # skips without a CUDA toolkit
    default_dir = os.environ.get("TORCH_EXTENSIONS_DIR")  # None: PyTorch's default root
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", default_dir or "")  # restored after the test (KernelBench's load sets it)

    def use_default_dir():
        if default_dir is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = default_dir

    use_default_dir()
    build_dir = str(tmp_path / "kb_build")
    _exec_like_kernelbench(repo_root, path, build_dir)
    capfd.readouterr()
    built = [f for root, _, files in os.walk(build_dir) for f in files if f.endswith(".so")]
    assert built, f"{path}: nothing was built under {build_dir}"
    stamps = {os.path.join(root, f): os.stat(os.path.join(root, f)).st_mtime_ns
              for root, _, files in os.walk(build_dir) for f in files}
    NewModel = _exec_like_kernelbench(repo_root, path, build_dir)
    err = capfd.readouterr().err
    assert "building" not in err.lower(), f"{path}: the second load rebuilt the extension:\n{err}"
    # no silent rebuild either: every file of the build (objects, library, ninja's log) as it was
    after = {os.path.join(root, f): os.stat(os.path.join(root, f)).st_mtime_ns
             for root, _, files in os.walk(build_dir) for f in files}
    assert after == stamps, f"{path}: the second load touched the build: " + ", ".join(
        sorted(os.path.basename(f) for f in set(after) | set(stamps) if after.get(f) != stamps.get(f)))
    # PyTorch's loader renames an extension (name_v1, name_v2, ...) when one process loads its name from a
    # second build directory, and the renamed one rebuilds in the first directory: each directory must get
    # its own name, so that a later load from the default directory (another test, a plain import) finds
    # its build
    kb_ext = NewModel.__init__.__globals__["_ext"].__name__
    assert not re.search(r"_v\d+$", kb_ext), f"{path}: KernelBench's load was versioned: {kb_ext}"
    assert kb_ext != first._ext.__name__, f"{path}: two build directories share the name {kb_ext}"
    use_default_dir()
    again = kernel_module(path, "kb_default_again_" + path[:-3])
    assert again._ext.__name__ == first._ext.__name__, (
        f"{path}: the default directory's extension was renamed: {first._ext.__name__} -> {again._ext.__name__}")

    ref = _reference(repo_root, load_module, path)
    torch.manual_seed(42)
    model = ref.Model(*ref.get_init_inputs())
    torch.manual_seed(42)
    new = NewModel(*ref.get_init_inputs())
    for (kr, vr), (kn, vn) in zip(model.state_dict().items(), new.state_dict().items()):
        assert kr == kn and torch.equal(vr, vn), f"{path}: seeded parameters differ at {kr} / {kn}"
    new.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match="CUDA"):
        new(*ref.get_inputs())


@pytest.mark.parametrize("path", KERNEL_FILES)
def test_extension_name_follows_the_toolkit_and_the_build_root(kernel_module, path, monkeypatch):
    """The file loads its extension under _extension_name(), and that name changes with the CUDA toolkit
    PyTorch found and with the build root: under one name, a process (or a shell) with another CUDA_HOME
    rebuilt the cached extension over the first one's build (ninja, no message), and a failed link there
    deleted it."""
    mod = kernel_module(path, "kb_name_" + path[:-3])
    name = mod._extension_name()
    assert mod._ext.__name__ == name
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", "/opt/another/cuda")
    other_toolkit = mod._extension_name()
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/tmp/another_root")
    other_root = mod._extension_name()
    assert len({name, other_toolkit, other_root}) == 3, (name, other_toolkit, other_root)


@pytest.mark.parametrize("path", KERNEL_FILES)
def test_precompile_on_cpu_matches_hopper_default(kernel_module, path, monkeypatch):
    """A CPU precompile (no GPU, no TORCH_CUDA_ARCH_LIST) builds the flags an H100 / H200 picks with no
    list, so the GPU evaluation finds the precompiled extension under the same name."""
    mod = kernel_module(path, "kb_flags_" + path[:-3])
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_flags = mod._gencode_flags()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_90", "sm_100", "sm_120"])
    assert mod._gencode_flags() == cpu_flags == ["-gencode=arch=compute_90a,code=sm_90a"]


def _kernelbench_eval_tool():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "kernelbench_eval.py")
    spec = importlib.util.spec_from_file_location("kernelbench_eval", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernelbench_eval_stand_ins_serve_its_result_record():
    """tools/kernelbench_eval.py: without pydantic, KernelExecResult (annotated fields with defaults, dict
    defaults among them) gets its defaults per instance and its keyword fields; load_dotenv, which
    kernelbench.utils calls on import, reads nothing; the LLM clients' names raise if called; installed packages
    get no stand-in."""
    tool = _kernelbench_eval_tool()
    made = tool.stand_ins(importable=lambda name: False)
    assert sorted(made) == ["dotenv", "litellm", "openai", "pydantic", "tqdm"]

    class KernelExecResult(made["pydantic"].BaseModel):  # KernelBench 423217d's fields, in part
        compiled: bool = False
        correctness: bool = False
        metadata: dict = {}
        runtime: float = -1.0

    first = KernelExecResult(compiled=True, runtime=0.5)
    second = KernelExecResult()
    first.metadata["note"] = 1
    assert (first.compiled, first.correctness, first.runtime) == (True, False, 0.5)
    assert (second.compiled, second.runtime, second.metadata) == (False, -1.0, {})
    assert made["dotenv"].load_dotenv() is False
    with pytest.raises(RuntimeError, match="stand-in"):
        made["openai"].OpenAI()
    assert tool.stand_ins(importable=lambda name: True) == {}


def test_kernelbench_eval_build_dir():
    """tools/kernelbench_eval.py's build folder: --build-dir where given, else TORCH_EXTENSIONS_DIR (the extensions
    built there are reused), else a new empty folder for each call."""
    tool = _kernelbench_eval_tool()
    assert tool.build_dir_for("/given", {"TORCH_EXTENSIONS_DIR": "/env"}) == "/given"
    assert tool.build_dir_for(None, {"TORCH_EXTENSIONS_DIR": "/env"}) == "/env"
    first, second = tool.build_dir_for(None, {}), tool.build_dir_for(None, {"TORCH_EXTENSIONS_DIR": ""})
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    assert os.listdir(first) == [] and os.listdir(second) == []
    os.rmdir(first)
    os.rmdir(second)
