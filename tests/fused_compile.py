"""Compiles every variant of the fused step's Triton kernels (src/torch_tweak/_runtime/fused_triton.py)
for an H100 (sm_90) with the installed Triton, on a machine without a GPU: Triton's own compiler
and the ptxas it ships turn each into a cubin. The interpreter (tests/test_fused_kernels.py) checks
what the kernels compute; this checks that the compiler takes them as the GPU will run them: every
candidate config of every product shape of Llama-3.2-1B and Qwen2.5-0.5B (the sum layout, tl.dot
with its pipeline stages, the split-K forms with their atomic counter), the attention of both and
of Qwen3 with its runtime loop bound, whole and in slices. Run without TRITON_INTERPRET
(tests/test_fused_kernels.py runs it in a child process):

    python tests/fused_compile.py
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from torch_tweak._runtime.decode import fused_triton, fused_tuning

TARGET = GPUTarget("cuda", 90, 32)
SMS = 132  # an H100 SXM's multiprocessors

PRODUCT_ARGS = {"x_ptr": "*{t}", "stride_xm": "i32", "norm_ptr": "*{t}", "eps": "fp32", "w0": "*{t}", "w1": "*{t}",
                "w2": "*{t}", "b0": "*{t}", "b1": "*{t}", "b2": "*{t}", "n0": "i32", "n1": "i32", "n2": "i32",
                "nb0": "i32", "nb1": "i32", "out_ptr": "*{t}", "stride_om": "i32", "res_ptr": "*{t}",
                "stride_rm": "i32", "part_ptr": "*fp32", "stride_pp": "i32", "stride_pm": "i32", "count_ptr": "*i32",
                "M": "i32"}
PRODUCT_CONSTANTS = ("K", "GROUPS", "NORM", "GLU", "RESIDUAL", "BIAS", "DOT", "PRECISION", "UPCAST", "BLOCK_M",
                     "BLOCK_N", "BLOCK_K", "SPLIT")
ATTENTION_ARGS = {"qkv_ptr": "*{t}", "stride_qm": "i32", "cos_ptr": "*{t}", "sin_ptr": "*{t}", "pos_ptr": "*i64",
                  "k_ptr": "*{t}", "v_ptr": "*{t}", "stride_kb": "i32", "stride_kh": "i32", "stride_kl": "i32",
                  "stride_vb": "i32", "stride_vh": "i32", "stride_vl": "i32", "qn_ptr": "*{t}", "kn_ptr": "*{t}",
                  "eps": "fp32", "scale": "fp32", "len_ptr": "*i64", "out_ptr": "*{t}", "stride_om": "i32",
                  "part_ptr": "*fp32", "count_ptr": "*i32"}
ATTENTION_CONSTANTS = ("H", "KV", "G", "D", "L", "QK_NORM", "LENGTH", "BLOCK_D", "BLOCK_L", "SPLIT", "RUNTIME")

SHAPES = {  # per model: (n, K, GROUPS, NORM, GLU, RESIDUAL, BIAS) of q/k/v, o, gate/up, down, the output projection
    "llama-1b": [(3072, 2048, 3, True, False, False, False), (2048, 2048, 1, False, False, True, False),
                 (16384, 2048, 2, True, False, False, False), (2048, 8192, 1, False, True, True, False),
                 (128256, 2048, 1, True, False, False, False)],
    "qwen2.5-0.5b": [(1152, 896, 3, True, False, False, True), (896, 896, 1, False, False, True, False),
                     (9728, 896, 2, True, False, False, False), (896, 4864, 1, False, True, True, False),
                     (151936, 896, 1, True, False, False, False)],
}


DIVISIBLE = {"stride_xm", "stride_om", "stride_rm", "n0", "n1", "n2", "stride_pp", "stride_pm", "stride_qm",
             "stride_kb", "stride_kh", "stride_kl", "stride_vb", "stride_vh", "stride_vl"}
"""The integer arguments that are multiples of 16 at these shapes: Triton's launcher tells the
compiler so (as it does of every pointer, 16-byte aligned), which lets it load 16 bytes at once."""


def compile_one(fn, args: dict, names: tuple, values: dict, dtype: str, config: fused_tuning.Config):
    """The kernel compiled as Triton's launcher would on an H100 (its pointers and the integers of
    DIVISIBLE marked divisible by 16); returns the compiled kernel."""
    signature = {name: kind.format(t=dtype) for name, kind in args.items()}
    signature.update({name: "constexpr" for name in names})
    order = list(signature)
    constexprs = {(order.index(name),): values[name] for name in names}
    attrs = {(order.index(name),): [["tt.divisibility", 16]] for name, kind in args.items()
             if kind.startswith("*") or name in DIVISIBLE}
    options = {"num_warps": config.warps, **({"num_stages": config.stages} if config.stages else {})}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                          options=options)


def products() -> int:
    """Every candidate config (product_configs at one row on an H100: the sum layout, tl.dot,
    the split-K forms where they are candidates) of the five products of both models, bf16; and
    one in fp32 (tl.dot in IEEE precision). One compile serves every bucket of tl.dot (its row
    tile is 16 for 1 to 8 rows; M is not specialized)."""
    done = 0
    for shapes in SHAPES.values():
        for n, k, groups, norm, glu, residual, bias in shapes:
            kind = dict(K=k, GROUPS=groups, NORM=norm, GLU=glu, RESIDUAL=residual, BIAS=bias)
            for config in fused_tuning.product_configs(1, n, k, SMS):
                values = dict(kind, DOT=config.dot, PRECISION=None, UPCAST=False, BLOCK_N=config.block_n,
                              BLOCK_K=config.block_k, BLOCK_M=16 if config.dot else 1, SPLIT=config.split)
                compile_one(fused_triton.product_kernel, PRODUCT_ARGS, PRODUCT_CONSTANTS, values, "bf16", config)
                done += 1
    config = fused_tuning.DOT_CONFIGS[1]
    values = dict(K=2048, GROUPS=3, NORM=True, GLU=False, RESIDUAL=False, BIAS=True, DOT=True, PRECISION="ieee",
                  UPCAST=False, BLOCK_N=32, BLOCK_K=64, BLOCK_M=16, SPLIT=1)
    compile_one(fused_triton.product_kernel, PRODUCT_ARGS, PRODUCT_CONSTANTS, values, "fp32", config)
    return done + 1


def attentions() -> int:
    """Llama-1B's groups of 4 and Qwen2.5-0.5B's of 7, Qwen3's norms: every config for the
    study's cache of 160 positions, and for one of 8192 (the slices)."""
    done = 0
    for h, kv, norm in ((32, 8, False), (14, 2, False), (16, 8, True)):
        for length in (160, 8192):
            for config in fused_tuning.attention_configs(length, h, SMS):
                if length > 160 and config.split == 1:
                    continue
                values = dict(H=h, KV=kv, G=h // kv, D=64, L=length, QK_NORM=norm, LENGTH=True, BLOCK_D=64,
                              BLOCK_L=config.block_l, SPLIT=config.split, RUNTIME=True)
                compile_one(fused_triton.attention_kernel, ATTENTION_ARGS, ATTENTION_CONSTANTS, values, "bf16",
                            config)
                done += 1
    return done


if __name__ == "__main__":
    if fused_triton.INTERPRETED:
        sys.exit("run without TRITON_INTERPRET: the interpreter's kernels do not compile")
    print(f"compiled {attentions()} attentions and {products()} products for sm_90 with Triton {triton.__version__}")
