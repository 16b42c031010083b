"""The Triton kernels: the scoring pass (attention output and a per-key statistic, two kernels per layer) and the
decode step of a folded layer (split-key, then a merge); each dequantizes a quantized layer's coded slots as it
reads them. ``triton_attention.py`` launches them with the launches of ``triton_blocks.py``.

A scorer that observes attention (H2O's column sums, KVzip's column maxima) needs every query's softmax weight of
every key, which flash-style kernels never hold: a weight is only final once its row's normaliser is. So the pass
runs twice over the keys, as FlashAttention's backward does:

1. ``_forward``: one program per block of query rows, the keys in blocks, online softmax; writes the output and
   each row's log-sum-exp. Memory: the output and one float per row.
2. ``_column_statistics``: one program per block of keys, the query rows in blocks; recomputes the logits,
   turns them into final weights with the row's log-sum-exp and reduces them over the rows (sum, or maximum)
   without storing any. Memory: one float per key.

Neither holds more than a block of logits, so memory stays linear in the length, and a layer costs two launches
whatever its length (the torch implementation of ``attention.py`` runs a chain of kernels per chunk of rows).

Rows are packed by KV head (grouped-query attention): a program's rows are (token, query head) pairs of one KV
head, token-major, so the keys and values of a block are read once for the whole group and a decode step's
query heads fill one block. A row at forward index i sees the slots up to ``T - q + i`` (the forward's tokens
are the cache's last q slots); an observed row never sees a dead slot (padding), an unobserved one sees every
slot (finite output, never read) and adds nothing to the statistic.

Logits use base 2 (``exp2``), with log2 e folded into the softmax scale; products accumulate in float32, and
float32 inputs multiply in full float32 (no TF32), so a float32 model keeps the tokens of its uncompressed run.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch implementation serves without Triton
    triton = tl = None

if triton is not None:

    @triton.jit
    def _dot(a, b, UPCAST: tl.constexpr):
        """a @ b with float32 accumulation. UPCAST: in float32 precision (float32 inputs: no TF32; under the
        interpreter, whose half-precision products are not reliable, exact products of the half inputs)."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _load_rows(Q, q_batch, stride_qh, stride_qm, kv_head, groups, length, row, dims, head_dim):
        """The queries of packed rows ``row`` (token-major: row = token · groups + head in group) (M, D)."""
        token = row // groups
        head = kv_head * groups + row % groups
        pointers = Q + q_batch + head[:, None] * stride_qh + token[:, None] * stride_qm + dims[None, :]
        return tl.load(pointers, mask=(token < length)[:, None] & (dims < head_dim)[None, :], other=0.0)

    @triton.jit
    def _load_slots(X, CODES, SCALES, MINIMUMS, slot, dims, mask, stride_xn, stride_cn, stride_sn, coded,
                    BITS: tl.constexpr, GROUP: tl.constexpr):
        """Channels ``dims`` of slots ``slot`` (broadcast to one tile, either orientation) in X's dtype. With
        ``BITS`` 8 or 4 the first ``coded`` slots are only codes (``kvcompress/quantization.py``'s grid:
        minimum + code · scale per ``GROUP`` channels, two 4-bit codes a byte, low nibble first), dequantized as
        they are read, and X holds the slots after them; with 16, X holds every slot."""
        if BITS == 16:
            return tl.load(X + slot * stride_xn + dims, mask=mask, other=0.0)
        held = tl.load(X + (slot - coded) * stride_xn + dims, mask=mask & (slot >= coded), other=0.0)
        in_codes = mask & (slot < coded)
        if BITS == 8:
            code = tl.load(CODES + slot * stride_cn + dims, mask=in_codes, other=0).to(tl.float32)
        else:
            pair = tl.load(CODES + slot * stride_cn + dims // 2, mask=in_codes, other=0).to(tl.int32)
            code = ((pair >> ((dims % 2) * 4)) & 15).to(tl.float32)
        scale = tl.load(SCALES + slot * stride_sn + dims // GROUP, mask=in_codes, other=0.0).to(tl.float32)
        minimum = tl.load(MINIMUMS + slot * stride_sn + dims // GROUP, mask=in_codes, other=0.0).to(tl.float32)
        return tl.where(in_codes, (code * scale + minimum).to(held.dtype), held)

    # lengths, and the strides that follow them, change from call to call: compiled once, not per value
    # (a quantized layer's codes: their strides, and the slots only codes hold, change likewise)
    _VARYING = ["stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_validb", "stride_validh", "length", "total",
                "stride_cb", "stride_ch", "stride_ksb", "stride_ksh", "stride_ksn", "coded"]

    @triton.jit(do_not_specialize=[*_VARYING, "stride_vb", "stride_vh", "stride_ob", "stride_om", "stride_vsb",
                                   "stride_vsh", "stride_vsn"])
    def _forward(
        Q, K, V, KC, KS, KM, VC, VS, VM, OUT, LSE, VALID, OBSERVED,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_cb, stride_ch, stride_cn, stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh, stride_vsn,
        stride_ob, stride_om, stride_oh, stride_validb, stride_validh,
        kv_heads, groups, length, total, coded, head_dim, scale,
        HAS_VALID: tl.constexpr, HAS_OBSERVED: tl.constexpr, NEED_OUTPUT: tl.constexpr, UPCAST: tl.constexpr,
        BITS: tl.constexpr, KEY_GROUP: tl.constexpr, VALUE_GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        block, pair = tl.program_id(0), tl.program_id(1)
        batch, kv_head = pair // kv_heads, pair % kv_heads
        base = total - length
        row = block * BLOCK_M + tl.arange(0, BLOCK_M)
        token = row // groups
        real = token < length
        dims = tl.arange(0, BLOCK_D)
        q = _load_rows(Q, batch.to(tl.int64) * stride_qb, stride_qh, stride_qm, kv_head, groups, length, row, dims,
                       head_dim)
        if HAS_OBSERVED:
            observed = tl.load(OBSERVED + batch * length + token, mask=real, other=0) != 0
        else:
            observed = real
        k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
        v_base = V + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
        codes_at = batch.to(tl.int64) * stride_cb + kv_head * stride_ch  # a quantized layer's (BITS 8 or 4)
        key_scales_at = batch.to(tl.int64) * stride_ksb + kv_head * stride_ksh
        value_scales_at = batch.to(tl.int64) * stride_vsb + kv_head * stride_vsh
        valid_base = VALID + batch.to(tl.int64) * stride_validb + kv_head * stride_validh
        tokens_seen = (block * BLOCK_M + BLOCK_M - 1) // groups + 1
        if tokens_seen > length:
            tokens_seen = length
        end = base + tokens_seen  # the block's last row sees no slot past this
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, end, BLOCK_N):
            slot = start + tl.arange(0, BLOCK_N)
            inside = slot < total
            k = _load_slots(k_base, KC + codes_at, KS + key_scales_at, KM + key_scales_at, slot[None, :],
                            dims[:, None], inside[None, :] & (dims < head_dim)[:, None], stride_kn, stride_cn,
                            stride_ksn, coded, BITS, KEY_GROUP)
            logits = _dot(q, k, UPCAST) * scale
            allowed = inside[None, :] & (slot[None, :] <= base + token[:, None])
            if HAS_VALID:
                live = tl.load(valid_base + slot, mask=inside, other=0) != 0
                allowed = allowed & (live[None, :] | ~observed[:, None])
            logits = tl.where(allowed, logits, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logits, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no live slot yet
            p = tl.exp2(logits - shift[:, None])
            alpha = tl.exp2(m_i - shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            if NEED_OUTPUT:
                v = _load_slots(v_base, VC + codes_at, VS + value_scales_at, VM + value_scales_at, slot[:, None],
                                dims[None, :], inside[:, None] & (dims < head_dim)[None, :], stride_vn, stride_cn,
                                stride_vsn, coded, BITS, VALUE_GROUP)
                acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
            m_i = m_new
        head = kv_head * groups + row % groups
        tl.store(LSE + (batch * kv_heads * groups + head) * length + token, m_i + tl.log2(l_i), mask=real)
        if NEED_OUTPUT:
            out = acc / l_i[:, None]
            pointers = (OUT + batch.to(tl.int64) * stride_ob + token[:, None] * stride_om + head[:, None] * stride_oh
                        + dims[None, :])
            tl.store(pointers, out.to(OUT.dtype.element_ty), mask=real[:, None] & (dims < head_dim)[None, :])

    @triton.jit(do_not_specialize=_VARYING)
    def _column_statistics(
        Q, K, KC, KS, KM, LSE, SCORES, VALID, OBSERVED,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_cb, stride_ch, stride_cn,
        stride_ksb, stride_ksh, stride_ksn, stride_validb, stride_validh,
        kv_heads, groups, length, total, coded, head_dim, scale,
        HAS_VALID: tl.constexpr, HAS_OBSERVED: tl.constexpr, MAXIMUM: tl.constexpr, UPCAST: tl.constexpr,
        BITS: tl.constexpr, KEY_GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        block, pair = tl.program_id(0), tl.program_id(1)
        batch, kv_head = pair // kv_heads, pair % kv_heads
        base = total - length
        slot = block * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = slot < total
        dims = tl.arange(0, BLOCK_D)
        k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
        key_scales_at = batch.to(tl.int64) * stride_ksb + kv_head * stride_ksh
        k = _load_slots(k_base, KC + batch.to(tl.int64) * stride_cb + kv_head * stride_ch, KS + key_scales_at,
                        KM + key_scales_at, slot[None, :], dims[:, None], inside[None, :] & (dims < head_dim)[:, None],
                        stride_kn, stride_cn, stride_ksn, coded, BITS, KEY_GROUP)
        counted = inside
        if HAS_VALID:
            valid_base = VALID + batch.to(tl.int64) * stride_validb + kv_head * stride_validh
            counted = counted & (tl.load(valid_base + slot, mask=inside, other=0) != 0)
        if MAXIMUM:
            acc = tl.full([BLOCK_N], float("-inf"), tl.float32)
        else:
            acc = tl.zeros([BLOCK_N], tl.float32)
        rows = groups * length
        first_token = block * BLOCK_N - base  # earlier rows see none of these slots
        if first_token < 0:
            first_token = 0
        for start in range(first_token * groups // BLOCK_M * BLOCK_M, rows, BLOCK_M):
            row = start + tl.arange(0, BLOCK_M)
            token = row // groups
            real = token < length
            q = _load_rows(Q, batch.to(tl.int64) * stride_qb, stride_qh, stride_qm, kv_head, groups, length, row, dims,
                           head_dim)
            head = kv_head * groups + row % groups
            lse = tl.load(LSE + (batch * kv_heads * groups + head) * length + token, mask=real, other=0.0)
            if HAS_OBSERVED:
                real = real & (tl.load(OBSERVED + batch * length + token, mask=real, other=0) != 0)
            logits = _dot(q, k, UPCAST) * scale - lse[:, None]
            allowed = real[:, None] & counted[None, :] & (slot[None, :] <= base + token[:, None])
            if MAXIMUM:
                acc = tl.maximum(acc, tl.max(tl.where(allowed, logits, float("-inf")), 0))
            else:
                acc += tl.sum(tl.where(allowed, tl.exp2(logits), 0.0), 0)
        if MAXIMUM:
            acc = tl.exp2(acc)
        tl.store(SCORES + pair * total + slot, acc, mask=inside)

    @triton.jit(do_not_specialize=["splits"])
    def _merge_splits(PART_MAX, PART_SUM, PART_OUTPUT, OUT, LSE, groups, head_dim, splits,
                      BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """A block of one (sequence, KV head) pair's output rows (B, 1, H, d), contiguous, from its chunks' partial
        softmaxes (a chunk with none of the pair's slots has maximum -inf and weighs 0), and each row's base-2
        log-sum-exp."""
        pair, row_block = tl.program_id(0), tl.program_id(1)
        row = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        real = row < groups
        dims = tl.arange(0, BLOCK_D)
        in_head = real[:, None] & (dims < head_dim)[None, :]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for split in range(0, splits):
            part = (pair * splits + split) * groups + row
            m_split = tl.load(PART_MAX + part, mask=real, other=float("-inf"))
            m_new = tl.maximum(m_i, m_split)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha, weight = tl.exp2(m_i - shift), tl.exp2(m_split - shift)
            l_i = l_i * alpha + tl.load(PART_SUM + part, mask=real, other=0.0) * weight
            partial = tl.load(PART_OUTPUT + part[:, None] * head_dim + dims[None, :], mask=in_head, other=0.0)
            acc = acc * alpha[:, None] + partial * weight[:, None]
            m_i = m_new
        head = pair * groups + row  # sequence · H + KV head · G + row: the row's query head, counted over the batch
        l_i = tl.where(real, l_i, 1.0)  # the block's rows past the group hold nothing
        tl.store(LSE + head, m_i + tl.log2(l_i), mask=real)
        tl.store(OUT + head[:, None] * head_dim + dims[None, :], (acc / l_i[:, None]).to(OUT.dtype.element_ty),
                 mask=in_head)

    @triton.jit(do_not_specialize=["stride_qb", "stride_kb", "stride_vb", "stride_cb", "stride_ksb", "stride_ksn",
                                   "stride_vsb", "stride_vsn", "total", "coded", "chunk", "splits"])
    def _folded_decode(
        Q, K, V, KC, KS, KM, VC, VS, VM, SLOT_HEAD, VALID, PART_MAX, PART_SUM, PART_OUTPUT, LOGITS,
        stride_qb, stride_qh, stride_kb, stride_kn, stride_vb, stride_vn,
        stride_cb, stride_cn, stride_ksb, stride_ksn, stride_vsb, stride_vsn,
        kv_heads, groups, total, coded, head_dim, chunk, splits, scale,
        HAS_VALID: tl.constexpr, SCORES: tl.constexpr, UPCAST: tl.constexpr, BITS: tl.constexpr,
        KEY_GROUP: tl.constexpr, VALUE_GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        split, pair, row_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        batch, kv_head = pair // kv_heads, pair % kv_heads
        row = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # a block of the group's query heads
        real = row < groups
        dims = tl.arange(0, BLOCK_D)
        in_head = dims < head_dim
        q = tl.load(Q + batch.to(tl.int64) * stride_qb + (kv_head * groups + row)[:, None] * stride_qh + dims[None, :],
                    mask=real[:, None] & in_head[None, :], other=0.0)
        k_base = K + batch.to(tl.int64) * stride_kb
        v_base = V + batch.to(tl.int64) * stride_vb
        codes_at = batch.to(tl.int64) * stride_cb  # a quantized layer's codes (BITS 8 or 4) and their scales
        key_scales_at, value_scales_at = batch.to(tl.int64) * stride_ksb, batch.to(tl.int64) * stride_vsb
        slot_base = batch.to(tl.int64) * total
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        begin = split * chunk
        end = begin + chunk
        if end > total:
            end = total
        for start in range(begin, end, BLOCK_N):
            slot = start + tl.arange(0, BLOCK_N)
            inside = slot < end
            mine = inside & (tl.load(SLOT_HEAD + slot_base + slot, mask=inside, other=-1) == kv_head)
            if HAS_VALID:
                mine = mine & (tl.load(VALID + slot_base + slot, mask=inside, other=0) != 0)
            if tl.max(mine.to(tl.int32), 0) > 0:  # another head's stretch: nothing to read
                k = _load_slots(k_base, KC + codes_at, KS + key_scales_at, KM + key_scales_at, slot[None, :],
                                dims[:, None], mine[None, :] & in_head[:, None], stride_kn, stride_cn, stride_ksn,
                                coded, BITS, KEY_GROUP)
                logits = tl.where(mine[None, :], _dot(q, k, UPCAST) * scale, float("-inf"))
                if SCORES:
                    tl.store(LOGITS + (batch * groups + row[:, None]).to(tl.int64) * total + slot[None, :], logits,
                             mask=real[:, None] & mine[None, :])
                m_new = tl.maximum(m_i, tl.max(logits, 1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(logits - shift[:, None])
                alpha = tl.exp2(m_i - shift)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = _load_slots(v_base, VC + codes_at, VS + value_scales_at, VM + value_scales_at, slot[:, None],
                                dims[None, :], mine[:, None] & in_head[None, :], stride_vn, stride_cn, stride_vsn,
                                coded, BITS, VALUE_GROUP)
                acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
                m_i = m_new
        part = (pair * splits + split) * groups + row
        tl.store(PART_MAX + part, m_i, mask=real)
        tl.store(PART_SUM + part, l_i, mask=real)
        tl.store(PART_OUTPUT + part[:, None] * head_dim + dims[None, :], acc, mask=real[:, None] & in_head[None, :])
