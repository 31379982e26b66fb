"""Causal attention over a sequence cut over the ``context`` axis: ring attention (docs/architecture.md, "Long
sequences").

Each rank of a context group of C holds two of the sequence's 2C equal chunks, i and 2C-1-i
(:func:`par4d.layout.sequence_chunks`), as its queries, keys and values. The keys and values travel around
the group: at step s a rank holds those of rank i - s (mod C) and sends them on to rank i + 1 while it
computes with them, so after C steps its queries have met every key. Between two chunks, query chunk a
and key chunk b: b < a is attended in full, b = a causally, b > a not at all (skipped: no work, no
transfer saved, as every rank's keys travel the whole ring). The two chunks per rank give every rank the
same work: chunk i has i earlier chunks, chunk 2C-1-i the rest. With documents (a packed window's), a query
attends only to keys of its own document, and a block in which none does is skipped too.

A block runs through torch's own attention kernel where it can (on CPUs, its flash kernel: it gives the
block's log-sum-exp and its backward takes the whole output's), else written out here (a document mask; the
GPU's kernels are not used yet). Each block's output and log-sum-exp are merged into the running ones in
fp32 (or the inputs' wider dtype):
``lse = log(e^lse + e^lse_b)``, ``out = out e^(lse_old - lse) + out_b e^(lse_b - lse)``. The backward runs
the ring again: the keys and values travel as in forward, each with its gradient's running sum; at each
step a rank adds its queries' part of the gradient of the keys and values it holds, and after the last
step every sum has come back to the rank it belongs to. With the final log-sum-exp the blocks need no
second pass (as flash attention's backward). Every transfer is a point-to-point pair recorded in the
ledger (``send``/``recv`` over ``context``), issued before the block's arithmetic and waited for after it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from par4d import comm
from par4d.grid import Grid
from par4d.parallel import check_context_form

KEYS, GRADIENTS = 11, 12      # message tags: a block's keys and values, their gradients' running sum


def chunk_ids(rank: int, ranks: int) -> tuple[int, int]:
    """The global chunk indices the context rank ``rank`` of ``ranks`` holds."""
    return rank, 2 * ranks - 1 - rank


def _pairs(mine: tuple[int, int], theirs: tuple[int, int]):
    """(query chunk, key chunk, causal) for every pair of a rank's chunks and a key block's that attend."""
    for a, qa in enumerate(mine):
        for b, kb in enumerate(theirs):
            if kb <= qa:
                yield a, b, kb == qa


def _allowed(causal: bool, n: int, documents: tuple[torch.Tensor, torch.Tensor] | None,
             device: torch.device) -> torch.Tensor | None:
    """Which keys each query of a block attends to, (B, 1, n, n) or (n, n); None: every one. ``documents``:
    the query chunk's and the key chunk's tokens' documents, (B, n) each."""
    allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril() if causal else None
    if documents is not None:
        same = (documents[0].unsqueeze(-1) == documents[1].unsqueeze(-2)).unsqueeze(1)
        allowed = same if allowed is None else same & allowed
    return allowed


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: torch.Tensor | None) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))


def _blocks(rank: int, ranks: int, step: int, documents: torch.Tensor | None, n: int, device: torch.device,
            fused: bool):
    """(query chunk, key chunk, causal, which keys each query attends to) of every pair of this rank's chunks
    and the block it holds at ``step`` that has one query attending to one key: a key chunk after the query
    chunk, or in other documents only, is skipped."""
    for a, b, causal in _pairs(chunk_ids(rank, ranks), chunk_ids((rank - step) % ranks, ranks)):
        pair = None
        if documents is not None:
            qa, kb = chunk_ids(rank, ranks)[a], chunk_ids((rank - step) % ranks, ranks)[b]
            pair = (documents[:, qa * n:(qa + 1) * n], documents[:, kb * n:(kb + 1) * n])
        if fused:                    # the kernel masks causally itself: no mask built, every pair has a key
            yield a, b, causal, None
            continue
        allowed = _allowed(causal, n, pair, device)
        if allowed is None or bool(allowed.any()):
            yield a, b, causal, allowed


def _fused(q: torch.Tensor, documents: torch.Tensor | None) -> bool:
    """Whether a block runs through torch's own attention kernel (on CPUs: its flash kernel, which gives the
    log-sum-exp the merge needs and takes it back for the backward) rather than written out here: a CPU tensor
    and no document mask (the kernel takes none). Elsewhere the blocks are written out (the GPU's kernels are
    not used yet)."""
    return q.device.type == "cpu" and documents is None


def _pass_on(grid: Grid, message: torch.Tensor, into: torch.Tensor, tag: int, overlap: bool,
             order: tuple[str, str] = ("send", "recv")) -> list:
    """``message`` sent to the next context rank and ``into`` received from the one before (handles in
    ``order``); without ``overlap`` both are waited for here (their handles then return at once)."""
    moves = {"send": lambda: comm.send(grid, message, "context", 1, tag, ring=True),
             "recv": lambda: comm.recv(grid, into, "context", -1, tag, ring=True)}
    handles = {kind: moves[kind]() for kind in ("send", "recv") if kind in order}
    if not overlap:
        for handle in handles.values():
            handle.wait()
    return [handles[kind] for kind in order]


def _widen(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention's key or value heads, each repeated for the ``groups`` query heads it serves."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _narrow(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_widen`'s input: each key or value head's, summed over the query heads it served."""
    return t if groups == 1 else t.unflatten(1, (t.shape[1] // groups, groups)).sum(2)


class RingAttention(torch.autograd.Function):
    """``(q, k, v)``: (B, H, 2c, hd) queries, (B, H_kv, 2c, hd) keys and values (grouped-query attention: H_kv
    dividing H, each serving H / H_kv query heads; only they travel), this rank's two chunks of c tokens each,
    to the causal attention output of its queries over the whole sequence, in the inputs' dtype."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid, scale: float,
                documents: torch.Tensor | None, overlap: bool) -> torch.Tensor:
        ranks, rank = grid.size("context"), grid.coord("context")
        dtype = torch.promote_types(q.dtype, torch.float32)
        groups = q.shape[1] // k.shape[1]
        qs = [part.contiguous() for part in q.to(dtype).chunk(2, dim=-2)]
        held = torch.stack([k, v]).contiguous()                        # one message: (2, B, H, 2c, hd)
        fused = _fused(q, documents)
        out = [torch.zeros_like(part) for part in qs]
        lse = [torch.full(part.shape[:-1], float("-inf"), dtype=dtype, device=q.device) for part in qs]
        for step in range(ranks):
            if step < ranks - 1:     # the next block on its way while this one is computed
                incoming = torch.empty_like(held)
                moves = _pass_on(grid, held, incoming, KEYS, overlap)
            ks, vs = ([_widen(part, groups) for part in t.to(dtype).chunk(2, dim=-2)] for t in held)
            for a, b, causal, allowed in _blocks(rank, ranks, step, documents, qs[0].shape[-2], q.device, fused):
                if fused:
                    attended, block_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        qs[a], ks[b], vs[b], 0.0, causal, scale=scale)
                else:
                    scores = _scores(qs[a], ks[b], scale, allowed)
                    block_lse = scores.logsumexp(-1)
                    attended = (scores - block_lse.unsqueeze(-1)).exp()
                merged = torch.logaddexp(lse[a], block_lse)
                weights = [(lse[a] - merged).exp(), (block_lse - merged).exp()]
                if documents is not None:   # a query with no key of its document here (yet): weight 0, not NaN
                    attended, weights = attended.nan_to_num(0.0), [w.nan_to_num(0.0) for w in weights]
                if not fused:
                    attended = attended @ vs[b]
                out[a] = out[a] * weights[0].unsqueeze(-1) + attended * weights[1].unsqueeze(-1)
                lse[a] = merged
            if step < ranks - 1:
                for move in moves:
                    move.wait()
                held = incoming
        out, lse = torch.cat(out, dim=-2), torch.cat(lse, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.grid, ctx.scale, ctx.documents, ctx.overlap = grid, scale, documents, overlap
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        grid, scale, documents, overlap = ctx.grid, ctx.scale, ctx.documents, ctx.overlap
        ranks, rank = grid.size("context"), grid.coord("context")
        dtype = out.dtype
        groups = q.shape[1] // k.shape[1]
        qs, dos = ([part.contiguous() for part in t.to(dtype).chunk(2, dim=-2)] for t in (q, grad_out))
        lses = [part.contiguous() for part in lse.chunk(2, dim=-1)]
        outs = [part.contiguous() for part in out.chunk(2, dim=-2)]
        deltas = [(d * o).sum(-1) for d, o in zip(dos, outs)]     # rowsum(dO * O)
        fused = _fused(q, documents)
        dq = [torch.zeros_like(part) for part in qs]
        held = torch.stack([k, v]).contiguous()
        summed = None              # the running gradient sum of the block held, from the rank before
        for step in range(ranks):
            if step < ranks - 1:
                incoming = torch.empty_like(held)
                moves = _pass_on(grid, held, incoming, KEYS, overlap)
            ks, vs = ([_widen(part, groups).contiguous() for part in t.to(dtype).chunk(2, dim=-2)] for t in held)
            dk, dv = [torch.zeros_like(t) for t in ks], [torch.zeros_like(t) for t in vs]
            for a, b, causal, allowed in _blocks(rank, ranks, step, documents, qs[0].shape[-2], q.device, fused):
                if fused:      # the kernel's backward, given the whole output and log-sum-exp of these queries
                    dqa, dkb, dvb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        dos[a], qs[a], ks[b], vs[b], outs[a], lses[a], 0.0, causal, scale=scale)
                    dq[a], dk[b], dv[b] = dq[a] + dqa, dk[b] + dkb, dv[b] + dvb
                    continue
                probs = (_scores(qs[a], ks[b], scale, allowed) - lses[a].unsqueeze(-1)).exp()
                dv[b] = dv[b] + probs.transpose(-1, -2) @ dos[a]
                dscores = probs * (dos[a] @ vs[b].transpose(-1, -2) - deltas[a].unsqueeze(-1))
                dq[a] = dq[a] + (dscores @ ks[b]) * scale
                dk[b] = dk[b] + (dscores.transpose(-1, -2) @ qs[a]) * scale
            mine = torch.stack([_narrow(torch.cat(dk, dim=-2), groups), _narrow(torch.cat(dv, dim=-2), groups)])
            if summed is not None:
                summed[1].wait()
                mine = summed[0] + mine
            # The sum goes on with the block: to the next rank, which holds this block at its next step (after
            # the last step, the block's own rank)
            back = torch.empty_like(mine)
            receive, sent = _pass_on(grid, mine, back, GRADIENTS, overlap, order=("recv", "send"))
            summed = (back, receive)
            if step < ranks - 1:
                for move in moves:
                    move.wait()
                held = incoming
            sent.wait()
        summed[1].wait()
        dkv = summed[0]
        return torch.cat(dq, dim=-2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def set_context_form(model: torch.nn.Module, form: str) -> torch.nn.Module:
    """Run every attention of ``model`` on a context axis in ``form`` (``ring`` or ``gather``): each module
    that has a ``context_form`` (par4d's attention, transformers' made parallel on a context axis)."""
    check_context_form(form)
    for module in model.modules():
        if hasattr(module, "context_form"):
            module.context_form = form
    return model


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid, scale: float,
                       documents: torch.Tensor | None = None) -> torch.Tensor:
    """The all-gather form: every rank's keys and values gathered over context once (grouped-query attention's
    heads as they are: small), then each of this rank's query chunks attends causally to the keys up to its
    own (torch's attention with the mask of global positions, and of documents where given); the backward
    reduce-scatters the keys' and values' gradients. Autograd through torch's ops: exact as the ring. A rank
    holds the whole sequence's keys and values, and torch's attention with a mask keeps the scores of a query
    chunk against them (no fused kernel on CPUs): for short or few key heads, where one collective beats
    2C - 1 steps."""
    from par4d.nn.collectives import gather_shards

    ranks, rank = grid.size("context"), grid.coord("context")
    n, groups = q.shape[-2] // 2, q.shape[1] // k.shape[1]
    mine = torch.stack([k, v]).movedim(3, 0)                                   # (2c, 2, B, H_kv, hd)
    every = gather_shards(mine.contiguous(), grid, "context").chunk(2 * ranks)  # rank r: chunks r, 2C-1-r
    order = [2 * c if c < ranks else 2 * (2 * ranks - 1 - c) + 1 for c in range(2 * ranks)]
    keys, values = torch.cat([every[i] for i in order]).movedim(0, 3)         # (B, H_kv, T, hd) each
    keys, values = _widen(keys, groups), _widen(values, groups)
    outs = []
    for a, chunk in enumerate(chunk_ids(rank, ranks)):
        end = (chunk + 1) * n
        allowed = torch.arange(end, device=q.device) <= torch.arange(chunk * n, end, device=q.device).unsqueeze(1)
        if documents is not None:
            same = documents[:, chunk * n:end].unsqueeze(-1) == documents[:, :end].unsqueeze(-2)
            allowed = (allowed & same).unsqueeze(1)
        outs.append(F.scaled_dot_product_attention(q[..., a * n:(a + 1) * n, :], keys[..., :end, :],
                                                   values[..., :end, :], attn_mask=allowed, scale=scale))
    return torch.cat(outs, dim=-2)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid,
                   scale: float | None = None, documents: torch.Tensor | None = None,
                   form: str = "ring", overlap: bool = True) -> torch.Tensor:
    """Causal attention of this rank's queries ``q`` (B, H, 2c, hd: its two chunks of every sequence over
    ``context``) over the whole sequence's keys and values (see the module's docstring); the scores scaled by
    ``scale`` (None: 1 / sqrt(hd)). ``documents`` (B, 2Cc): the document of every token of the whole sequences,
    in order: a query attends only to keys of its own document. ``form``: ``ring`` (keys and values around the
    ring, each block hidden behind the one before's attention) or ``gather`` (:func:`gathered_attention`);
    ``overlap`` False: every transfer of the ring waited for where it is issued (``--overlap`` without
    ``cp``)."""
    if q.shape[-2] % 2:
        raise ValueError(f"ring attention: {q.shape[-2]} tokens here are not this rank's two equal chunks")
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise ValueError(f"ring attention: {q.shape[1]} query heads and keys {tuple(k.shape)}, values "
                         f"{tuple(v.shape)}: give as many key as value heads, dividing the query heads")
    check_context_form(form)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if form == "gather":
        return gathered_attention(q, k, v, grid, scale, documents)
    return RingAttention.apply(q, k, v, grid, scale, documents, overlap)
