"""The experts of a mixture as model folders store them, one matrix per expert, and as transformers 5
holds them, stacked.

In memory a block's experts are ``experts.gate_up_proj`` (E, 2I, D) and ``experts.down_proj`` (E, D, I)
(:mod:`par4d.adopt.moe`); the folders on the Hub, and those ``save_pretrained`` writes, keep each expert's
matrices apart: Mixtral's ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up) and ``w2`` (down), and
its router as ``block_sparse_moe.gate``; Qwen3-MoE's and OLMoE's ``mlp.experts.{e}.gate_proj``, ``up_proj``
and ``down_proj``. :func:`stacked_view` reads such a folder as if it held the stacked tensors, a rank
reading only the rows of its own experts; :func:`per_expert` writes the stacked tensors back apart.
"""

from __future__ import annotations

import re

import torch

# model_type -> (the block's name in the files, its experts' gate, up and down matrices)
STORED = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
          "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
_APART = re.compile(r"^(?P<block>.*)\.experts\.(?P<expert>\d+)\.(?P<matrix>w1|w2|w3|gate_proj|up_proj|down_proj)"
                    r"\.weight$")
_ROLES = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class _Stacked:
    """One stacked tensor read from its experts' matrices (each ``parts[e]``: the (handle, key, rows) pieces
    of expert e, one above the other), as a ``safe_open`` handle reads a tensor: whole, or sliced."""

    def __init__(self, parts: list[list[tuple[object, str, int]]], cols: int):
        self.parts = parts
        self.shape = (len(parts), sum(rows for _, _, rows in parts[0]), cols)

    def get_slice(self, key: str) -> _Stacked:
        return self

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self[(slice(None),) * 3]

    def __getitem__(self, src: tuple[slice, ...]) -> torch.Tensor:
        bounds = [s.indices(n) for s, n in zip(src, self.shape)]
        if any(step != 1 for _, _, step in bounds):
            raise ValueError(f"a stacked view of experts reads contiguous slices only, not {src}")
        (e0, e1, _), (r0, r1, _), (c0, c1, _) = bounds
        handle, key, _ = self.parts[0][0]
        out = [handle.get_slice(key)[0:0, c0:c1].reshape(0, max(c1 - c0, 0))]   # an empty read keeps the dtype
        for e in range(e0, e1):
            start = 0
            for handle, key, n in self.parts[e]:        # the rows asked for that this piece holds
                lo, hi = max(r0, start), min(r1, start + n)
                if lo < hi:
                    out.append(handle.get_slice(key)[lo - start:hi - start, c0:c1])
                start += n
        return torch.cat(out).reshape(max(e1 - e0, 0), max(r1 - r0, 0), max(c1 - c0, 0))


def stacked_view(handles: dict[str, object], shapes: dict[str, tuple[int, ...]]
                 ) -> tuple[dict[str, object], dict[str, tuple[int, ...]]]:
    """(handles, shapes) of a model folder's tensors, with each block's experts stored apart also readable
    under the stacked names (``{block}.experts.gate_up_proj`` and ``down_proj``; Mixtral's
    ``block_sparse_moe`` read as ``mlp``, its router too). Unchanged for a folder without such experts."""
    handles, shapes = dict(handles), dict(shapes)
    found: dict[str, dict[str, dict[int, str]]] = {}        # block -> role -> expert -> key
    for key in list(handles):
        if ".block_sparse_moe." in key:                      # Mixtral's router and experts: the block is mlp
            renamed = key.replace(".block_sparse_moe.", ".mlp.")
            _vacant(handles, renamed, key)
            handles[renamed], shapes[renamed] = _Renamed(handles[key], key), shapes[key]
        match = _APART.match(key.replace(".block_sparse_moe.", ".mlp."))
        if match:
            found.setdefault(match["block"], {}).setdefault(_ROLES[match["matrix"]], {})[int(match["expert"])] = key
    for block, roles in found.items():
        count = len(roles.get("gate", ()))
        if set(roles) != {"gate", "up", "down"} or any(sorted(r) != list(range(count)) for r in roles.values()):
            continue                   # not a whole set of experts: left as the file names them (refused there)
        inner, dim = shapes[roles["gate"][0]]
        for role, want in (("gate", (inner, dim)), ("up", (inner, dim)), ("down", (dim, inner))):
            odd = [roles[role][e] for e in range(count) if tuple(shapes[roles[role][e]]) != want]
            if odd:
                raise ValueError(f"{odd[0]} has shape {tuple(shapes[odd[0]])}, where the block's experts are "
                                 f"{want} ({roles['gate'][0]}'s): every expert of a block has one shape")
        gate_up = [[(handles[roles[m][e]], roles[m][e], inner) for m in ("gate", "up")] for e in range(count)]
        down = [[(handles[roles["down"][e]], roles["down"][e], dim)] for e in range(count)]
        for name, parts, cols in (("gate_up_proj", gate_up, dim), ("down_proj", down, inner)):
            _vacant(handles, f"{block}.experts.{name}", roles["gate"][0])
            stacked = _Stacked(parts, cols)
            handles[f"{block}.experts.{name}"] = stacked
            shapes[f"{block}.experts.{name}"] = stacked.shape
    return handles, shapes


def _vacant(handles: dict[str, object], name: str, source: str) -> None:
    """Refuse a folder that holds ``name`` itself and also as ``source`` (both layouts): which to read is not
    par4d's guess."""
    if name in handles:
        raise ValueError(f"the weights hold {name} and also {source}, the same tensor in another layout: keep one")


class _Renamed:
    """A tensor of an open file read under another name."""

    def __init__(self, handle: object, key: str):
        self.handle, self.key = handle, key

    def get_slice(self, key: str):
        return self.handle.get_slice(self.key)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.handle.get_tensor(self.key)


def per_expert(tensors: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """The state dict ``tensors`` (transformers 5's names) as a model folder of ``model_type`` stores it:
    each block's stacked experts one matrix per expert, under the family's names (:data:`STORED`)."""
    if model_type not in STORED:
        return tensors
    block_name, (gate, up, down) = STORED[model_type]
    out = {}
    for key, tensor in tensors.items():
        is_mixture = ".mlp.experts." in key or key.endswith(".mlp.gate.weight")
        stored = key.replace(".mlp.", f".{block_name}.") if is_mixture else key
        if key.endswith(".experts.gate_up_proj"):
            prefix = stored.removesuffix("gate_up_proj")
            for e, (g, u) in enumerate(t.chunk(2) for t in tensor):
                out[f"{prefix}{e}.{gate}.weight"], out[f"{prefix}{e}.{up}.weight"] = g.contiguous(), u.contiguous()
        elif key.endswith(".experts.down_proj"):
            prefix = stored.removesuffix("down_proj")
            out.update({f"{prefix}{e}.{down}.weight": t.contiguous() for e, t in enumerate(tensor)})
        else:
            out[stored] = tensor
    return out
