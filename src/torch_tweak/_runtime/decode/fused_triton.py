"""The Triton kernels of tweak's own decode step (fused_step.py); their torch references are
fused_kernels.py's, the choice of their launch settings fused_tuning.py's.

Two kernels serve a whole layer in five launches:

- ``product_kernel``: y = x @ W.T (+ bias) for M rows (1 to 8, one batch bucket) with up to
  three weights in one launch, the programs split among them (q, k, v read as one weight; gate
  and up as one), fp32 accumulation, the model's dtype out. Two layouts:

  - ``DOT``: one program per block of BLOCK_N weight rows for all M rows at once: the x tile is
    [BLOCK_M = 16, BLOCK_K] (rows past M masked to 0), the weight tile [BLOCK_N, BLOCK_K],
    acc += tl.dot(x, w.T); each weight read once for all rows;
  - the sum layout (``DOT`` off): one program per (block of BLOCK_N weight rows, row), BLOCK_M
    = 1: acc[BLOCK_N] += sum(w * x[None, :], axis=1) in fp32, 2-D tiles only (what serves one
    row best; for several rows each program reads the weight again).

  ``SPLIT`` > 1 cuts K into SPLIT parts, one program each (grid axis 1): each writes its fp32
  partial sums, and the last program of a column block to finish (counted by an atomic counter,
  which it sets back to 0 for the next launch) sums the parts in their order (deterministic)
  and applies the epilogue: no second launch. For products with few column blocks and a long
  K (the down projection) it puts more programs on the card.

  Optional prologues: the RMS norm of x (the model's rounding: normalized in fp32, rounded to
  the dtype, times the norm's weight in the dtype) or silu(gate) * up read from a gate/up
  buffer; optional epilogue: a residual added (the product rounded first, as the model adds
  two tensors of its dtype).
- ``attention_kernel``: one program per (row, query head): its query's and its group's new
  key's optional per-head RMS norm (Qwen3's q_norm/k_norm) and rotary embedding from the
  model's own cos/sin table at the position; the first program of each key/value group writes
  the new key and value into the cache there; every program attends over the cache's
  positions 0..position-1 (never the one being written: no program reads what another writes)
  blockwise with an online softmax over [BLOCK_L, D] tiles, and over the new position from
  registers; the layer's length counter set to position + 1. ``SPLIT`` > 1 cuts the positions
  into SPLIT slices, one program each (flash-decoding): each writes its (max, sum, output)
  partial and the last of a head to finish combines them (the same atomic counter as the
  product's split).

Loop bounds: the product's are compile-time constants (its reduction length); the attention's
is the position (work proportional to the positions attended, not to the cache's length) where
``RUNTIME`` is set, which is everywhere but Triton's interpreter (TRITON_INTERPRET=1, with which
the CPU tests run every kernel): it cannot take a runtime bound with numpy 2.4, so there the
loop runs over the whole cache with the blocks past the position skipped. Only what Triton 3.6
has is used. TRITON_INTERPRET is read when this module is imported (triton.jit decides then:
INTERPRETED).
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
    def _accumulate(x_ptr, stride_xm, norm_ptr, eps, w_ptr, rows, ns, n_size, part, M, K: tl.constexpr,
                    NORM: tl.constexpr, GLU: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT: tl.constexpr):
        """The [BLOCK_M, BLOCK_N] fp32 sums of this program's part of K (the whole K unless
        SPLIT > 1: part `part` of SPLIT consecutive spans, each a whole number of blocks)."""
        rstd = tl.zeros((BLOCK_M,), tl.float32)
        if NORM:  # over the whole K, whatever part this program sums
            rstd = _rms_scale(x_ptr, stride_xm, rows, M, K, eps, BLOCK_K, BLOCK_M)
        span: tl.constexpr = (K + SPLIT * BLOCK_K - 1) // (SPLIT * BLOCK_K) * BLOCK_K
        lo = 0
        if SPLIT > 1:
            lo = part * span
        if DOT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        else:
            acc = tl.zeros((BLOCK_N,), tl.float32)
        for start in range(0, span, BLOCK_K):
            cols = lo + start + tl.arange(0, BLOCK_K)
            x = _input_tile(x_ptr, stride_xm, rows, cols, M, K, norm_ptr, rstd, NORM, GLU)
            wmask = (ns[:, None] < n_size) & (cols[None, :] < K)
            w = tl.load(w_ptr + ns[:, None] * K + cols[None, :], mask=wmask, other=0.0)
            if DOT:
                if UPCAST:  # the interpreter's tl.dot takes no bf16: the same exact products in fp32
                    acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
            else:  # one row: x is [1, BLOCK_K]
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)
        if not DOT:
            acc = acc[None, :]
        return acc

    @triton.jit
    def _finish(acc, b_ptr, ns, n_size, col, rows, M, out_ptr, stride_om, res_ptr, stride_rm,
                RESIDUAL: tl.constexpr, BIAS: tl.constexpr):
        """The epilogue: the bias added in fp32, the dtype, the residual added, the store."""
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
    def _last(count_ptr, SPLIT: tl.constexpr):
        """Whether this program is the last of SPLIT to reach here (its counter then set back to
        0). What each wrote before is visible to the last: the barrier makes every thread's
        stores precede the counter's update, whose acq_rel order publishes them (gpu scope)."""
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        last = done == SPLIT - 1
        if last:
            tl.store(count_ptr, 0)
        return last

    @triton.jit
    def _split_finish(acc, part, part_ptr, stride_pp, stride_pm, count_ptr, b_ptr, ns, n_size, col, rows, M,
                      out_ptr, stride_om, res_ptr, stride_rm, RESIDUAL: tl.constexpr, BIAS: tl.constexpr,
                      SPLIT: tl.constexpr):
        """This part's sums stored; the last part of the column block sums all parts in their
        order (read past the L1 cache: other programs wrote them) and applies the epilogue."""
        mask = (rows[:, None] < M) & (ns[None, :] < n_size)
        at = part_ptr + rows[:, None] * stride_pm + col + ns[None, :]
        tl.store(at + part * stride_pp, acc, mask=mask)
        if _last(count_ptr, SPLIT):
            total = tl.zeros_like(acc)
            for p in tl.static_range(SPLIT):
                total += tl.load(at + p * stride_pp, mask=mask, other=0.0, cache_modifier=".cg")
            _finish(total, b_ptr, ns, n_size, col, rows, M, out_ptr, stride_om, res_ptr, stride_rm, RESIDUAL, BIAS)

    @triton.jit(do_not_specialize=["M"])  # one compile serves every bucket (1 would be a constant)
    def product_kernel(x_ptr, stride_xm, norm_ptr, eps, w0, w1, w2, b0, b1, b2, n0, n1, n2, nb0, nb1,
                       out_ptr, stride_om, res_ptr, stride_rm, part_ptr, stride_pp, stride_pm, count_ptr, M,
                       K: tl.constexpr, GROUPS: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr,
                       RESIDUAL: tl.constexpr, BIAS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr):
        """out[:, col + n] = prologue(x) @ W_g[n].T (+ b_g[n]) (+ res[:, n]) for the block of rows n
        of the weight g this program reads (module docs). Grid: (column blocks, SPLIT) with DOT,
        (column blocks, M * SPLIT) without."""
        pid = tl.program_id(0)
        lane = tl.program_id(1) // SPLIT  # the row of the sum layout (0 with DOT)
        part = tl.program_id(1) % SPLIT
        w_ptr, b_ptr, n_size, col, block = _group(pid, w0, w1, w2, b0, b1, b2, n0, n1, n2, nb0, nb1, GROUPS)
        rows = lane + tl.arange(0, BLOCK_M)
        ns = block * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _accumulate(x_ptr, stride_xm, norm_ptr, eps, w_ptr, rows, ns, n_size, part, M, K, NORM, GLU, DOT,
                          PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT)
        if SPLIT == 1:
            _finish(acc, b_ptr, ns, n_size, col, rows, M, out_ptr, stride_om, res_ptr, stride_rm, RESIDUAL, BIAS)
        else:
            count = count_ptr + lane * tl.num_programs(0) + pid
            _split_finish(acc, part, part_ptr, stride_pp, stride_pm, count, b_ptr, ns, n_size, col, rows, M,
                          out_ptr, stride_om, res_ptr, stride_rm, RESIDUAL, BIAS, SPLIT)

    @triton.jit
    def _head(row_ptr, head, d, partner, sign, dmask, cos, sin, norm_ptr, eps, D: tl.constexpr,
              QK_NORM: tl.constexpr):
        """Head `head` of a q or k row ([D]): the optional per-head RMS norm, then the rotary
        embedding (x * cos + rotate_half(x) * sin, rounded once); the dtype's."""
        x = tl.load(row_ptr + head * D + d, mask=dmask, other=0.0)
        xp = tl.load(row_ptr + head * D + partner, mask=dmask, other=0.0)
        dtype = row_ptr.dtype.element_ty
        if QK_NORM:
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
            w = tl.load(norm_ptr + d, mask=dmask, other=0.0).to(tl.float32)
            wp = tl.load(norm_ptr + partner, mask=dmask, other=0.0).to(tl.float32)
            x = (w * (xf * rstd).to(dtype).to(tl.float32)).to(dtype)
            xp = (wp * (xp.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype)
        y = x.to(tl.float32) * cos + sign * xp.to(tl.float32) * sin
        return y.to(dtype)

    @triton.jit
    def _block(q, k_base, v_base, stride_kl, stride_vl, start, hi, d, dmask, m_i, l_i, acc, scale,
               BLOCK_L: tl.constexpr):
        """The online softmax carried over the positions start..start+BLOCK_L-1 below `hi`."""
        ls = start + tl.arange(0, BLOCK_L)
        lmask = ls < hi
        mask = lmask[:, None] & dmask[None, :]
        kb = tl.load(k_base + ls[:, None] * stride_kl + d[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(kb * q[None, :], axis=1) * scale
        s = tl.where(lmask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: the block holds a position below hi
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        vb = tl.load(v_base + ls[:, None] * stride_vl + d[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vb, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        return m_new, l_i, acc

    @triton.jit
    def _past(q, k_base, v_base, stride_kl, stride_vl, lo, hi, d, dmask, m_i, l_i, acc, scale,
              L: tl.constexpr, BLOCK_L: tl.constexpr, RUNTIME: tl.constexpr):
        """The online softmax over the cache's positions lo..hi-1 (lo a multiple of BLOCK_L)."""
        if RUNTIME:
            for start in range(lo, hi, BLOCK_L):
                m_i, l_i, acc = _block(q, k_base, v_base, stride_kl, stride_vl, start, hi, d, dmask, m_i, l_i, acc,
                                       scale, BLOCK_L)
        else:  # the interpreter: a compile-time bound, the blocks outside lo..hi-1 skipped
            for start in range(0, L, BLOCK_L):
                if (start >= lo) & (start < hi):
                    m_i, l_i, acc = _block(q, k_base, v_base, stride_kl, stride_vl, start, hi, d, dmask, m_i, l_i,
                                           acc, scale, BLOCK_L)
        return m_i, l_i, acc

    @triton.jit
    def _combine(m_i, l_i, acc, part, slot, count_ptr, d, SPLIT: tl.constexpr, BLOCK_D: tl.constexpr):
        """This slice's (max, sum, output) stored at its row of `slot` ([SPLIT, BLOCK_D + 2] fp32);
        for the last slice of the head to finish, whether it is and the combined (output, sum)."""
        width: tl.constexpr = BLOCK_D + 2
        two = tl.arange(0, 2)
        tl.store(slot + part * width + d, acc)
        tl.store(slot + part * width + BLOCK_D + two, tl.where(two == 0, m_i, l_i))
        last = _last(count_ptr, SPLIT)
        parts = tl.arange(0, SPLIT)
        ms = tl.load(slot + parts * width + BLOCK_D, mask=last, other=0.0, cache_modifier=".cg")
        ls = tl.load(slot + parts * width + BLOCK_D + 1, mask=last, other=0.0, cache_modifier=".cg")
        accs = tl.load(slot + parts[:, None] * width + d[None, :], mask=last, other=0.0, cache_modifier=".cg")
        weight = tl.exp(ms - tl.max(ms, axis=0))  # the slice holding the new position has a finite max
        total = tl.where(last, tl.sum(ls * weight, axis=0), 1.0)  # (the others store nothing)
        return last, tl.sum(accs * weight[:, None], axis=0), total

    @triton.jit
    def attention_kernel(qkv_ptr, stride_qm, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, stride_kb, stride_kh,
                         stride_kl, stride_vb, stride_vh, stride_vl, qn_ptr, kn_ptr, eps, scale, len_ptr,
                         out_ptr, stride_om, part_ptr, count_ptr, H: tl.constexpr, KV: tl.constexpr,
                         G: tl.constexpr, D: tl.constexpr, L: tl.constexpr, QK_NORM: tl.constexpr,
                         LENGTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, SPLIT: tl.constexpr,
                         RUNTIME: tl.constexpr):
        """One (row, query head) (grid axis 0), one slice of the positions (axis 1): rotary on its
        query and its group's new key, the key and value written into the cache at the position
        by the group's first program, attention over positions 0..position (module docs)."""
        pid = tl.program_id(0)
        part = tl.program_id(1)
        b = pid // H
        h = pid % H
        kvh = h // G
        pos = tl.load(pos_ptr).to(tl.int32)
        d = tl.arange(0, BLOCK_D)
        inside = pos < L  # a position past the cache writes and reads nothing of it (its output is garbage)
        dmask = (d < D) & inside
        partner = tl.where(d < D // 2, d + D // 2, d - D // 2)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + pos * D + d, mask=dmask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + d, mask=dmask, other=0.0).to(tl.float32)
        row = qkv_ptr + b * stride_qm
        key = _head(row + H * D, kvh, d, partner, sign, dmask, cos, sin, kn_ptr, eps, D, QK_NORM)
        value = tl.load(row + (H + KV) * D + kvh * D + d, mask=dmask, other=0.0)
        k_base = k_ptr + b * stride_kb + kvh * stride_kh
        v_base = v_ptr + b * stride_vb + kvh * stride_vh
        if (h % G == 0) & (part == 0):
            tl.store(k_base + pos * stride_kl + d, key, mask=dmask)
            tl.store(v_base + pos * stride_vl + d, value, mask=dmask)
        q = _head(row, h, d, partner, sign, dmask, cos, sin, qn_ptr, eps, D, QK_NORM).to(tl.float32)
        past = tl.where(inside, pos, 0)
        chunk = (past + SPLIT * BLOCK_L - 1) // (SPLIT * BLOCK_L) * BLOCK_L
        lo = part * chunk
        hi = tl.minimum(lo + chunk, past)
        first = part == 0  # the new position, from registers, goes with the first slice: its max is finite
        m_i = tl.where(first, tl.sum(q * key.to(tl.float32), axis=0) * scale, float("-inf"))
        l_i = tl.where(first, 1.0, 0.0)
        acc = tl.where(first, value.to(tl.float32), 0.0)
        m_i, l_i, acc = _past(q, k_base, v_base, stride_kl, stride_vl, lo, hi, d, dmask, m_i, l_i, acc, scale, L,
                              BLOCK_L, RUNTIME)
        optrs = out_ptr + b * stride_om + h * D + d
        if SPLIT == 1:
            tl.store(optrs, (acc / l_i).to(out_ptr.dtype.element_ty), mask=d < D)
        else:
            slot = part_ptr + pid * SPLIT * (BLOCK_D + 2)
            last, acc, l_i = _combine(m_i, l_i, acc, part, slot, count_ptr + pid, d, SPLIT, BLOCK_D)
            tl.store(optrs, (acc / l_i).to(out_ptr.dtype.element_ty), mask=(d < D) & last)
        if LENGTH:
            one = tl.arange(0, 1)
            tl.store(len_ptr + one * 0, pos + 1 + one * 0, mask=(pid == 0) & (part == 0))
