"""Compiles every variant of the fused step's Triton kernels (src/torch_tweak/_runtime/fused_triton.py)
for an H100 (sm_90) with the installed Triton, on a machine without a GPU: Triton's own compiler
and the ptxas it ships turn each into a cubin. The interpreter (tests/test_fused_kernels.py) checks
what the kernels compute; this checks that the compiler takes them as the GPU will run them.
Run without TRITON_INTERPRET (tests/test_fused_kernels.py runs it in a child process):

    python tests/fused_compile.py
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from torch_tweak._runtime import fused_kernels, fused_triton

TARGET = GPUTarget("cuda", 90, 32)

PRODUCT_ARGS = {"x_ptr": "*{t}", "stride_xm": "i32", "norm_ptr": "*{t}", "eps": "fp32", "w0": "*{t}", "w1": "*{t}",
                "w2": "*{t}", "b0": "*{t}", "b1": "*{t}", "b2": "*{t}", "n0": "i32", "n1": "i32", "n2": "i32",
                "nb0": "i32", "nb1": "i32", "out_ptr": "*{t}", "stride_om": "i32", "res_ptr": "*{t}",
                "stride_rm": "i32", "M": "i32"}
PRODUCT_CONSTANTS = ("K", "GROUPS", "NORM", "GLU", "RESIDUAL", "BIAS", "DOT", "PRECISION", "UPCAST", "BLOCK_M",
                     "BLOCK_N", "BLOCK_K")
ATTENTION_ARGS = {"qkv_ptr": "*{t}", "stride_qm": "i32", "cos_ptr": "*{t}", "sin_ptr": "*{t}", "pos_ptr": "*i64",
                  "k_ptr": "*{t}", "v_ptr": "*{t}", "stride_kb": "i32", "stride_kh": "i32", "stride_kl": "i32",
                  "stride_vb": "i32", "stride_vh": "i32", "stride_vl": "i32", "qn_ptr": "*{t}", "kn_ptr": "*{t}",
                  "eps": "fp32", "scale": "fp32", "len_ptr": "*i64", "out_ptr": "*{t}", "stride_om": "i32"}
ATTENTION_CONSTANTS = ("H", "KV", "G", "D", "L", "QK_NORM", "LENGTH", "BLOCK_G", "BLOCK_D", "BLOCK_L")


def compile_one(fn, args: dict, names: tuple, values: dict, dtype: str, warps: int) -> None:
    signature = {name: kind.format(t=dtype) for name, kind in args.items()}
    signature.update({name: "constexpr" for name in names})
    order = list(signature)
    constexprs = {(order.index(name),): values[name] for name in names}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                   options={"num_warps": warps})


def products() -> int:
    """The step's five products (q/k/v, o, gate/up, down, the output projection) at the Llama-1B
    shape, every config of buckets 1 and 8, bf16; and one in fp32 (tl.dot in IEEE precision)."""
    kinds = [dict(K=2048, GROUPS=3, NORM=True, GLU=False, RESIDUAL=False, BIAS=True),
             dict(K=2048, GROUPS=1, NORM=False, GLU=False, RESIDUAL=True, BIAS=False),
             dict(K=2048, GROUPS=2, NORM=True, GLU=False, RESIDUAL=False, BIAS=False),
             dict(K=8192, GROUPS=1, NORM=False, GLU=True, RESIDUAL=True, BIAS=False),
             dict(K=896, GROUPS=1, NORM=True, GLU=False, RESIDUAL=False, BIAS=False)]
    done = 0
    for rows in (1, 8):
        for config in fused_kernels.product_configs(rows):
            for kind in (kinds if rows == 1 or config == fused_kernels.product_configs(rows)[-1] else kinds[:1]):
                values = dict(kind, DOT=config.dot, PRECISION=None, UPCAST=False, BLOCK_N=config.block_n,
                              BLOCK_K=config.block_k, BLOCK_M=16 if config.dot else rows)
                compile_one(fused_triton.product_kernel, PRODUCT_ARGS, PRODUCT_CONSTANTS, values, "bf16", config.warps)
                done += 1
    values = dict(kinds[0], DOT=True, PRECISION="ieee", UPCAST=False, BLOCK_N=32, BLOCK_K=64, BLOCK_M=16)
    compile_one(fused_triton.product_kernel, PRODUCT_ARGS, PRODUCT_CONSTANTS, values, "fp32", 4)
    return done + 1


def attentions() -> int:
    """Llama-1B's groups of 4 and Qwen2.5-0.5B's of 7, Qwen3's norms, every block of the configs."""
    done = 0
    for h, kv, norm in ((32, 8, False), (14, 2, False), (16, 8, True)):
        for config in fused_kernels.ATTENTION_CONFIGS:
            g = h // kv
            values = dict(H=h, KV=kv, G=g, D=64, L=160, QK_NORM=norm, LENGTH=True, BLOCK_G=1 << (g - 1).bit_length(),
                          BLOCK_D=64, BLOCK_L=config.block_l)
            compile_one(fused_triton.attention_kernel, ATTENTION_ARGS, ATTENTION_CONSTANTS, values, "bf16",
                        config.warps)
            done += 1
    return done


if __name__ == "__main__":
    if fused_triton.INTERPRETED:
        sys.exit("run without TRITON_INTERPRET: the interpreter's kernels do not compile")
    print(f"compiled {products()} products and {attentions()} attentions for sm_90 with Triton {triton.__version__}")
