"""The Triton kernels of tweak's own decode step (fused_step.py); their torch references and the
choice of their block sizes are fused_kernels.py's.

Two kernels serve a whole layer in five launches:

- ``product_kernel``: y = x @ W.T (+ bias) for M rows (1 to 8, one batch bucket) with up to
  three weights in one launch, the programs split among them (q, k, v read as one weight; gate
  and up as one), each weight read once for all rows; fp32 accumulation, the model's dtype out.
  Optional prologues: the RMS norm of x (the model's rounding: normalized in fp32, rounded to
  the dtype, times the norm's weight in the dtype) or silu(gate) * up read from a gate/up
  buffer; optional epilogue: a residual added (the product rounded first, as the model adds
  two tensors of its dtype). With DOT the rows are padded to a 16-row tile for tl.dot.
- ``attention_kernel``: one program per (row, key/value head): the new key's (and, per head of
  its group, the queries') optional per-head RMS norm (Qwen3's q_norm/k_norm) and rotary
  embedding from the model's own cos/sin table at the position, the new key and value written
  into the cache there, attention of the group's queries over positions 0..position (the past
  ones from the cache, blockwise with an online softmax; the new one from registers, so no
  program reads what another writes), and the layer's length counter set to position + 1.

Every loop bound is a compile-time constant (the reduction length, the cache's length): the
interpreter (TRITON_INTERPRET=1, with which the CPU tests run every kernel) cannot take a
runtime bound with numpy 2.4, and nothing here needs one. Only what Triton 3.6 has is used.
TRITON_INTERPRET is read when this module is imported (triton.jit decides then: INTERPRETED).
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves without Triton; fused_kernels says why this one does not
    triton = None
    tl = None

INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""Whether this module's kernels were made for Triton's interpreter (they then run on the CPU)."""


if triton is not None:

    @triton.jit
    def _rms_scale(x_ptr, stride_xm, rows, M, K: tl.constexpr, eps, BLOCK_K: tl.constexpr,
                   BLOCK_M: tl.constexpr):
        """Per row, 1 / sqrt(mean(x^2) + eps) over its K values, in fp32."""
        total = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            mask = (rows[:, None] < M) & (cols[None, :] < K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            total += tl.sum(x * x, axis=1)
        return 1.0 / tl.sqrt(total / K + eps)

    @triton.jit
    def _input_tile(x_ptr, stride_xm, rows, cols, M, K: tl.constexpr, norm_ptr, rstd,
                    NORM: tl.constexpr, GLU: tl.constexpr):
        """The [rows, cols] tile of a product's input in the model's dtype, after its prologue."""
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        ptrs = x_ptr + rows[:, None] * stride_xm + cols[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0)
        dtype = x_ptr.dtype.element_ty
        if GLU:  # x holds [gate | up]: silu(gate) rounded, times up rounded, as the model's MLP
            up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
            gate = x.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
            x = (act.to(tl.float32) * up).to(dtype)
        if NORM:
            weight = tl.load(norm_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * rstd[:, None]).to(dtype)
            x = (weight[None, :] * normed.to(tl.float32)).to(dtype)
        return x

    @triton.jit
    def _group(pid, w0, w1, w2, b0, b1, b2, n0, n1, n2, nb0, nb1, GROUPS: tl.constexpr):
        """Which weight program `pid` reads: (its weight, its bias, its rows, its first column in
        the output, its block among the weight's)."""
        w_ptr = w0
        b_ptr = b0
        n_size = n0
        col = n0 * 0
        block = pid
        if GROUPS > 1:
            if pid >= nb0:
                w_ptr = w1
                b_ptr = b1
                n_size = n1
                col = n0
                block = pid - nb0
        if GROUPS > 2:
            if pid >= nb0 + nb1:
                w_ptr = w2
                b_ptr = b2
                n_size = n2
                col = n0 + n1
                block = pid - nb0 - nb1
        return w_ptr, b_ptr, n_size, col, block

    @triton.jit
    def product_kernel(x_ptr, stride_xm, norm_ptr, eps, w0, w1, w2, b0, b1, b2, n0, n1, n2, nb0, nb1,
                       out_ptr, stride_om, res_ptr, stride_rm, M, K: tl.constexpr, GROUPS: tl.constexpr,
                       NORM: tl.constexpr, GLU: tl.constexpr, RESIDUAL: tl.constexpr, BIAS: tl.constexpr,
                       DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[:, col + n] = prologue(x) @ W_g[n].T (+ b_g[n]) (+ res[:, n]) for the block of rows n
        of the weight g this program reads (module docs)."""
        pid = tl.program_id(0)
        w_ptr, b_ptr, n_size, col, block = _group(pid, w0, w1, w2, b0, b1, b2, n0, n1, n2, nb0, nb1, GROUPS)
        rows = tl.arange(0, BLOCK_M)
        ns = block * BLOCK_N + tl.arange(0, BLOCK_N)
        rstd = tl.zeros((BLOCK_M,), tl.float32)
        if NORM:
            rstd = _rms_scale(x_ptr, stride_xm, rows, M, K, eps, BLOCK_K, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x = _input_tile(x_ptr, stride_xm, rows, cols, M, K, norm_ptr, rstd, NORM, GLU)
            wmask = (ns[:, None] < n_size) & (cols[None, :] < K)
            w = tl.load(w_ptr + ns[:, None] * K + cols[None, :], mask=wmask, other=0.0)
            if DOT:
                if UPCAST:  # the interpreter's tl.dot takes no bf16: the same exact products in fp32
                    acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
            else:
                acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        if BIAS:
            acc += tl.load(b_ptr + ns, mask=ns < n_size, other=0.0).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        y = acc.to(dtype)
        omask = (rows[:, None] < M) & (ns[None, :] < n_size)
        if RESIDUAL:
            res = tl.load(res_ptr + rows[:, None] * stride_rm + ns[None, :], mask=omask, other=0.0)
            y = (res.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(out_ptr + rows[:, None] * stride_om + col + ns[None, :], y, mask=omask)

    @triton.jit
    def _rotated(row_ptr, heads, d, partner, sign, dmask, hmask, cos, sin, norm_ptr, eps, D: tl.constexpr,
                 QK_NORM: tl.constexpr):
        """Heads `heads` (a column vector of head indices) of a q or k row, each [d]: the optional
        per-head RMS norm, then the rotary embedding (x * cos + rotate_half(x) * sin); the dtype's."""
        mask = hmask[:, None] & dmask[None, :]
        x = tl.load(row_ptr + heads[:, None] * D + d[None, :], mask=mask, other=0.0)
        xp = tl.load(row_ptr + heads[:, None] * D + partner[None, :], mask=mask, other=0.0)
        dtype = row_ptr.dtype.element_ty
        if QK_NORM:
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
            w = tl.load(norm_ptr + d, mask=dmask, other=0.0).to(tl.float32)
            wp = tl.load(norm_ptr + partner, mask=dmask, other=0.0).to(tl.float32)
            x = (w[None, :] * (xf * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
            xp = (wp[None, :] * (xp.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
        y = x.to(tl.float32) * cos[None, :] + sign[None, :] * xp.to(tl.float32) * sin[None, :]
        return y.to(dtype)

    @triton.jit
    def _past(q, k_base, v_base, stride_kl, stride_vl, pos, d, dmask, m_i, l_i, acc, scale,
              L: tl.constexpr, BLOCK_L: tl.constexpr):
        """The online softmax carried over the cache's positions 0..pos-1, block by block."""
        for start in range(0, L, BLOCK_L):
            if start < pos:
                ls = start + tl.arange(0, BLOCK_L)
                lmask = ls < pos
                mask = lmask[:, None] & dmask[None, :]
                kb = tl.load(k_base + ls[:, None] * stride_kl + d[None, :], mask=mask, other=0.0).to(tl.float32)
                s = tl.sum(q[:, None, :] * kb[None, :, :], axis=2) * scale
                s = tl.where(lmask[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                vb = tl.load(v_base + ls[:, None] * stride_vl + d[None, :], mask=mask, other=0.0).to(tl.float32)
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vb[None, :, :], axis=1)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def attention_kernel(qkv_ptr, stride_qm, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, stride_kb, stride_kh,
                         stride_kl, stride_vb, stride_vh, stride_vl, qn_ptr, kn_ptr, eps, scale, len_ptr,
                         out_ptr, stride_om, H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr,
                         D: tl.constexpr, L: tl.constexpr, QK_NORM: tl.constexpr, LENGTH: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
        """One (row, key/value head): rotary on its new key and its group's queries, the key and
        value written into the cache at the position, attention over positions 0..position."""
        pid = tl.program_id(0)
        b = pid // KV
        kvh = pid % KV
        pos = tl.load(pos_ptr)
        d = tl.arange(0, BLOCK_D)
        inside = pos < L  # a position past the cache writes and reads nothing of it (its output is garbage)
        dmask = (d < D) & inside
        partner = tl.where(d < D // 2, d + D // 2, d - D // 2)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + pos * D + d, mask=dmask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + d, mask=dmask, other=0.0).to(tl.float32)
        row = qkv_ptr + b * stride_qm
        one = tl.arange(0, 1)
        key = _rotated(row + H * D, kvh + one, d, partner, sign, dmask, one < 1, cos, sin, kn_ptr, eps, D, QK_NORM)
        value = tl.load(row + (H + KV) * D + kvh * D + d[None, :] + one[:, None] * 0, mask=dmask[None, :], other=0.0)
        k_base = k_ptr + b * stride_kb + kvh * stride_kh
        v_base = v_ptr + b * stride_vb + kvh * stride_vh
        tl.store(k_base + pos * stride_kl + d[None, :] + one[:, None] * 0, key, mask=dmask[None, :])
        tl.store(v_base + pos * stride_vl + d[None, :] + one[:, None] * 0, value, mask=dmask[None, :])
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        q = _rotated(row, kvh * G + g, d, partner, sign, dmask, gmask, cos, sin, qn_ptr, eps, D, QK_NORM)
        q = q.to(tl.float32)
        m_i = tl.sum(q * key.to(tl.float32), axis=1) * scale  # the new position's score first: finite
        l_i = tl.full((BLOCK_G,), 1.0, tl.float32)
        acc = value.to(tl.float32) + tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        m_i, l_i, acc = _past(q, k_base, v_base, stride_kl, stride_vl, pos, d, dmask, m_i, l_i, acc, scale, L, BLOCK_L)
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        optrs = out_ptr + b * stride_om + (kvh * G + g)[:, None] * D + d[None, :]
        tl.store(optrs, out, mask=gmask[:, None] & (d < D)[None, :])
        if LENGTH:
            if kvh == 0:
                tl.store(len_ptr + one * 0, pos + 1 + one * 0)
