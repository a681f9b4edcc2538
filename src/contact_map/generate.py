"""The multi-line CUDA text of contact_map's tree, generated at bundle time: tools/bundle.py replaces each
placeholder @NAME@ in src/contact_map/ with expansions()[NAME]."""


def _wgmma_rs(n, ab="tf32"):
    """Body of wgmma_rs<n> (ab "tf32": m64{n}k8) or wgmma_rs16<T, n> (ab "f16" / "bf16": m64{n}k16, B not
    transposed): the inline PTX of wgmma with A from the registers a[0..3], B by descriptor `db`, its n/2
    accumulator operands spelled out."""
    shape, tail = ("k8", "p, 1, 1") if ab == "tf32" else ("k16", "p, 1, 1, 0")
    nacc = n // 2
    regs = ", ".join(f"%{i}" for i in range(nacc))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
    a_ops = "{" + ", ".join(f"%{nacc + i}" for i in range(4)) + "}"
    ins = "".join(f'"r"(a[{i}]), ' for i in range(4)) + '"l"(db), "r"(acc)'
    return (f'    asm volatile("{{\\n .reg .pred p;\\n setp.ne.b32 p, %{nacc + 5}, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.m64n{n}{shape}.f32.{ab}.{ab} {{{regs}}}, {a_ops}, %{nacc + 4}, {tail};\\n}}\\n"\n'
            f"                 : {outs}\n"
            f"                 : {ins});")


def expansions():
    """{"@WGMMA_RS_64@": wgmma_rs<64>'s body, ...}: the m64nNk8 TF32 and m64nNk16 fp16 / bf16 wgmma with A
    from registers, N = 64 and 32."""
    out = {}
    for n in (64, 32):
        out[f"@WGMMA_RS_{n}@"] = _wgmma_rs(n)
        for ab in ("f16", "bf16"):
            out[f"@WGMMA_RS_{ab.upper()}_{n}@"] = _wgmma_rs(n, ab)
    return out
