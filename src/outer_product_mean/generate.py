"""The multi-line CUDA text of outer_product_mean's tree, generated at bundle time: tools/bundle.py replaces
each placeholder @NAME@ in src/outer_product_mean/ with expansions()[NAME]."""


def _wgmma_asm(n, a_regs=0, ab="tf32"):
    """Body of a wgmma_tf32_m64{n}k8 wrapper (ab "tf32") or of a m64{n}k16 one (ab "bf16" / "f16", both
    operands K-major): the inline PTX with its n/2 accumulator operands spelled out; A from shared
    memory (descriptor `da`) or, with a_regs = 4, from the registers a[0..3]."""
    # 16-bit: imm-trans-b 0 (K-major B), and imm-trans-a 0 where A is in shared memory
    shape, tail = ("k8", "p, 1, 1") if ab == "tf32" else ("k16", "p, 1, 1, 0" if a_regs else "p, 1, 1, 0, 0")
    nacc = n // 2
    regs = ", ".join(f"%{i}" for i in range(nacc))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
    if a_regs:
        a_ops = "{" + ", ".join(f"%{nacc + i}" for i in range(a_regs)) + "}"
        ins = "".join(f'"r"(a[{i}]), ' for i in range(a_regs)) + '"l"(db), "r"(acc)'
    else:
        a_ops, ins = f"%{nacc}", '"l"(da), "l"(db), "r"(acc)'
    nb, npred = nacc + max(a_regs, 1), nacc + max(a_regs, 1) + 1
    return (f'  asm volatile("{{\\n .reg .pred p;\\n setp.ne.b32 p, %{npred}, 0;\\n"\n'
            f'               "wgmma.mma_async.sync.aligned.m64n{n}{shape}.f32.{ab}.{ab} {{{regs}}}, {a_ops}, %{nb}, {tail};\\n}}\\n"\n'
            f"               : {outs}\n"
            f"               : {ins});\n")


def expansions():
    """{"@WGMMA_M64N128K8@": the body of wgmma_tf32_m64n128k8, ...}: the wgmma wrappers the kernels use."""
    return {"@WGMMA_M64N128K8@": _wgmma_asm(128), "@WGMMA_M64N64K8_RS@": _wgmma_asm(64, 4),
            "@WGMMA_BF16_M64N128K16@": _wgmma_asm(128, ab="bf16"), "@WGMMA_F16_M64N128K16@": _wgmma_asm(128, ab="f16"),
            "@WGMMA_F16_M64N64K16_RS@": _wgmma_asm(64, 4, ab="f16"),
            "@WGMMA_BF16_M64N64K16_RS@": _wgmma_asm(64, 4, ab="bf16")}
