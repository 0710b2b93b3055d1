"""lmcache.kernels: gather/scatter between paged KV memory and chunk buffers.

Every layout is checked against a naive per-token Python loop written straight from the
layout's axis roles (not from the kernels' canonical view), on contiguous tensors, slices,
permuted storage and stacked tensors, in float32/float16/bfloat16 filled with random bits
(NaNs included: comparisons are bit-exact). The Triton kernels are checked against the
torch reference in interpreter mode, in a subprocess so that ``TRITON_INTERPRET=1`` is set
before triton is imported and nothing else in this process sees it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lmcache.kernels as K
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lmcache.kernels import KVLayout, get_layout, register_layout

ROOT = Path(__file__).resolve().parents[2]
BUILTIN = ("vllm_flash_attn", "blocks_first", "flashinfer_nhd", "flashinfer_hnd", "mla", "contiguous")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STORAGES = ("contiguous", "slice", "permuted", "stacked")
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# A made-up layout nobody ships: heads first, K/V axis second to last. Registering it is
# all it takes for every kernel (torch and Triton) to support it.
ODD = register_layout(KVLayout("test_odd_hbokd", heads_axis=0, block_axis=1, offset_axis=2, kv_axis=3, dim_axis=4))


# --------------------------------------------------------------------------- helpers
def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (same strides), so NaNs compare equal to themselves."""
    return t.view(_INT[t.element_size()])


def random_bits(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    lo, hi = -(2 ** (8 * size - 1)), 2 ** (8 * size - 1) - 1
    return torch.randint(lo, hi, tuple(shape), generator=gen, dtype=_INT[size]).view(dtype)


def layer_shape(layout: KVLayout, num_blocks: int, block_size: int, heads: int, dim: int) -> list[int]:
    sizes = {
        "kv_axis": 2,
        "block_axis": num_blocks,
        "offset_axis": block_size if layout.paged else num_blocks * block_size,
        "heads_axis": heads,
        "dim_axis": dim,
    }
    shape = [0] * layout.ndim
    for role, n in sizes.items():
        axis = getattr(layout, role)
        if axis is not None:
            shape[axis] = n
    return shape


def make_layers(layout, num_layers, num_blocks, block_size, heads, dim, dtype, storage, gen):
    """Per-layer tensors (a list, or one stacked tensor) in ``layout`` with random bits.

    ``slice``: every layer is a strided slice of a bigger tensor; ``permuted``: storage
    allocated in reversed axis order and permuted back (like vLLM's stride order);
    ``stacked``: one ``(num_layers, ...)`` tensor, itself a slice of a bigger one.
    """
    shape = layer_shape(layout, num_blocks, block_size, heads, dim)
    nd = len(shape)
    if storage == "contiguous":
        return [random_bits(shape, dtype, gen) for _ in range(num_layers)]
    if storage == "slice":
        out = []
        for _ in range(num_layers):
            big = random_bits([n + 2 for n in shape], dtype, gen)
            out.append(big[tuple(slice(1, 1 + n) for n in shape)])
        return out
    if storage == "permuted":
        perm = list(reversed(range(nd)))
        inv = [perm.index(i) for i in range(nd)]
        return [random_bits([shape[p] for p in perm], dtype, gen).permute(inv) for _ in range(num_layers)]
    if storage == "stacked":
        big = random_bits([num_layers + 1] + [n + 1 for n in shape], dtype, gen)
        return big[(slice(1, None),) + tuple(slice(0, n) for n in shape)]
    raise AssertionError(storage)


def as_list(layers) -> list[torch.Tensor]:
    return list(layers.unbind(0)) if isinstance(layers, torch.Tensor) else list(layers)


def clone_layers(layers):
    return layers.clone() if isinstance(layers, torch.Tensor) else [t.clone() for t in layers]


def naive_cell(t: torch.Tensor, layout: KVLayout, kv: int, slot: int) -> torch.Tensor:
    """The ``(heads, dim)`` values of one token's K or V, indexed axis by axis."""
    idx: list[object] = [slice(None)] * t.dim()
    if layout.block_axis is not None:
        bs = t.shape[layout.offset_axis]
        idx[layout.block_axis], idx[layout.offset_axis] = slot // bs, slot % bs
    else:
        idx[layout.offset_axis] = slot
    if layout.kv_axis is not None:
        idx[layout.kv_axis] = kv
    v = t[tuple(idx)]
    if layout.heads_axis is None:
        return v.unsqueeze(0)
    return v if layout.heads_axis < layout.dim_axis else v.t()


def naive_gather(layers, layout, slots, out, skip):
    for li, t in enumerate(as_list(layers)):
        for i in range(skip, len(slots)):
            s = int(slots[i])
            if s < 0:
                continue
            for kv in range(layout.num_kv):
                out[li, kv, i] = naive_cell(t, layout, kv, s)


def naive_scatter(chunk, layout, slots, layers, skip):
    for li, t in enumerate(as_list(layers)):
        for i in range(skip, len(slots)):
            s = int(slots[i])
            if s < 0:
                continue
            for kv in range(layout.num_kv):
                naive_cell(t, layout, kv, s).copy_(chunk[li, kv, i])


# --------------------------------------------------------------------------- hypothesis cases
@st.composite
def cases(draw, layouts=BUILTIN + ("test_odd_hbokd",)):
    layout = get_layout(draw(st.sampled_from(layouts)))
    num_layers = draw(st.integers(1, 3))
    num_blocks = draw(st.integers(1, 5))
    block_size = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 3))
    dim = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(DTYPES))
    storage = draw(st.sampled_from(STORAGES))
    seed = draw(st.integers(0, 2**31 - 1))
    capacity = num_blocks * block_size
    num_tokens = draw(st.integers(0, min(capacity, 12)))
    slots = draw(st.permutations(range(capacity)))[:num_tokens]
    pad = draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    slots = [-1 if p else s for s, p in zip(slots, pad)]
    skip = draw(st.integers(0, num_tokens))
    strided_out = draw(st.booleans())
    return dict(
        layout=layout, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size, heads=heads,
        dim=dim, dtype=dtype, storage=storage, seed=seed, slots=torch.tensor(slots, dtype=torch.int64),
        skip=skip, strided_out=strided_out,
    )  # fmt: skip


def setup(case):
    gen = torch.Generator().manual_seed(case["seed"])
    layers = make_layers(
        case["layout"], case["num_layers"], case["num_blocks"], case["block_size"], case["heads"], case["dim"],
        case["dtype"], case["storage"], gen,
    )  # fmt: skip
    shape = K.chunk_shape(layers, case["layout"], len(case["slots"]))
    if case["strided_out"]:  # a chunk buffer that is a token slice of a bigger one
        big = random_bits(shape[:2] + (shape[2] + 3,) + shape[3:], case["dtype"], gen)
        out = big[:, :, 2 : 2 + shape[2]]
    else:
        out = random_bits(shape, case["dtype"], gen)
    return layers, out, gen


HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HYP
@given(cases())
def test_gather_matches_naive_loop(case):
    layers, out, _ = setup(case)
    want = out.clone()
    naive_gather(layers, case["layout"], case["slots"], want, case["skip"])
    before = clone_layers(layers)
    got = K.gather(layers, case["layout"], case["slots"], out, case["skip"])
    assert got is out
    assert torch.equal(bits(out), bits(want))  # prefix, padding rows untouched too
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(as_list(before), as_list(layers)))


@HYP
@given(cases())
def test_scatter_matches_naive_loop(case):
    layers, chunk, _ = setup(case)
    want = clone_layers(layers)
    naive_scatter(chunk, case["layout"], case["slots"], want, case["skip"])
    chunk_before = chunk.clone()
    K.scatter(chunk, case["layout"], case["slots"], layers, case["skip"])
    for a, b in zip(as_list(layers), as_list(want)):
        assert torch.equal(bits(a), bits(b))  # only the slots of moved tokens changed
    assert torch.equal(bits(chunk), bits(chunk_before))


@HYP
@given(cases())
def test_scatter_then_gather_round_trips_bit_exactly(case):
    layers, chunk, gen = setup(case)
    K.scatter(chunk, case["layout"], case["slots"], layers, case["skip"])
    sentinel = random_bits(chunk.shape, case["dtype"], gen)
    back = sentinel.clone()
    K.gather(layers, case["layout"], case["slots"], back, case["skip"])
    moved = torch.zeros(len(case["slots"]), dtype=torch.bool)
    moved[case["skip"] :] = case["slots"][case["skip"] :] >= 0
    assert torch.equal(bits(back[:, :, moved]), bits(chunk[:, :, moved]))
    assert torch.equal(bits(back[:, :, ~moved]), bits(sentinel[:, :, ~moved]))


@settings(max_examples=25, deadline=None)
@given(cases())
def test_layerwise_matches_all_layers(case):
    layers, out, _ = setup(case)
    whole = out.clone()
    K.gather(layers, case["layout"], case["slots"], whole, case["skip"])
    per = out.clone()
    for i, t in enumerate(as_list(layers)):
        K.gather_layer(t, case["layout"], case["slots"], per[i], case["skip"])
    assert torch.equal(bits(per), bits(whole))

    a, b = clone_layers(layers), clone_layers(layers)
    K.scatter(whole, case["layout"], case["slots"], a, case["skip"])
    for i, t in enumerate(as_list(b)):
        K.scatter_layer(whole[i], case["layout"], case["slots"], t, case["skip"])
    for x, y in zip(as_list(a), as_list(b)):
        assert torch.equal(bits(x), bits(y))


# --------------------------------------------------------------------------- focused cases
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("name", BUILTIN + ("test_odd_hbokd",))
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_every_layout_and_storage_against_naive_loop(name, storage, padded):
    """Deterministic coverage of every (layout, storage) pair, both reference code paths."""
    lay = get_layout(name)
    gen = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        layers = make_layers(lay, 2, 3, 4, 2, 5, dtype, storage, gen)
        slots = torch.randperm(12, generator=gen)[:7]
        if padded:
            slots[4] = -1
        out = random_bits(K.chunk_shape(layers, lay, 7), dtype, gen)
        want = out.clone()
        naive_gather(layers, lay, slots, want, 2)
        K.gather(layers, lay, slots, out, 2)
        assert torch.equal(bits(out), bits(want)), dtype
        chunk = random_bits(out.shape, dtype, gen)
        want_layers = clone_layers(layers)
        naive_scatter(chunk, lay, slots, want_layers, 2)
        K.scatter(chunk, lay, slots, layers, 2)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(as_list(layers), as_list(want_layers))), dtype


def test_layers_under_test_really_are_non_contiguous():
    gen = torch.Generator().manual_seed(0)
    for name in BUILTIN:
        lay = get_layout(name)
        for storage in ("slice", "permuted", "stacked"):
            layers = make_layers(lay, 2, 3, 4, 2, 5, torch.float16, storage, gen)
            assert not any(t.is_contiguous() for t in as_list(layers)), (name, storage)


def test_stacked_tensor_and_list_agree():
    gen = torch.Generator().manual_seed(1)
    stacked = random_bits((3, 2, 4, 4, 2, 8), torch.bfloat16, gen)  # (L, 2, blocks, bs, heads, dim)
    slots = torch.tensor([5, 6, 7, 12, -1, 0])
    a = torch.zeros(3, 2, 6, 2, 8, dtype=torch.bfloat16)
    b = torch.zeros_like(a)
    K.gather(stacked, "vllm_flash_attn", slots, a, skip=1)
    K.gather(list(stacked), "vllm_flash_attn", slots, b, skip=1)
    assert torch.equal(bits(a), bits(b))
    assert torch.equal(bits(a[2, 1, 3]), bits(stacked[2, 1, 3, 0]))  # slot 12 = block 3, offset 0


def test_gather_into_slots_of_a_documented_example():
    # vLLM FlashAttention: (2, num_blocks, block_size, heads, dim); slot = block * bs + off
    layer = torch.arange(2 * 3 * 4 * 1 * 2, dtype=torch.float32).reshape(2, 3, 4, 1, 2)
    out = torch.full((1, 2, 3, 1, 2), -7.0)
    K.gather([layer], "vllm_flash_attn", torch.tensor([9, -1, 2]), out)
    assert torch.equal(out[0, :, 0], layer[:, 2, 1])
    assert torch.equal(out[0, :, 1], torch.full((2, 1, 2), -7.0))  # padding: untouched
    assert torch.equal(out[0, :, 2], layer[:, 0, 2])


def test_mla_chunk_has_one_kv_and_one_head():
    layer = torch.randn(4, 8, 576)  # (num_blocks, block_size, latent)
    assert K.chunk_shape([layer, layer], "mla", 10) == (2, 1, 10, 1, 576)
    out = torch.empty(1, 10, 1, 576)
    K.gather_layer(layer, "mla", torch.arange(10) + 3, out)
    assert torch.equal(out[0, :, 0], layer.reshape(32, 576)[3:13])


def test_contiguous_layout_slot_is_the_token_index():
    layer = torch.randn(2, 20, 3, 4).transpose(2, 3).contiguous().transpose(2, 3)  # non-contiguous view
    assert not layer.is_contiguous()
    out = torch.empty(2, 5, 3, 4)
    K.gather_layer(layer, "contiguous", [19, 0, 4, 5, 6], out)
    assert torch.equal(out, layer[:, [19, 0, 4, 5, 6]])


@pytest.mark.parametrize("name", BUILTIN)
def test_other_element_types_move_bit_exactly(name):
    lay = get_layout(name)
    gen = torch.Generator().manual_seed(2)
    dtypes = [torch.int8, torch.float64]
    if hasattr(torch, "float8_e4m3fn"):
        dtypes.append(torch.float8_e4m3fn)
    for dtype in dtypes:
        layers = make_layers(lay, 2, 3, 4, 2, 6, dtype, "permuted", gen)
        slots = torch.tensor([3, 11, -1, 0, 7])
        chunk = random_bits(K.chunk_shape(layers, lay, 5), dtype, gen)
        K.scatter(chunk, lay, slots, layers, skip=1)
        back = torch.zeros_like(chunk)
        K.gather(layers, lay, slots, back, skip=1)
        for i in (1, 3, 4):
            assert torch.equal(bits(back[:, :, i]), bits(chunk[:, :, i])), dtype


def test_prefix_slots_are_neither_touched_nor_checked():
    layer = torch.randn(2, 2, 4, 1, 3)
    chunk = torch.randn(1, 2, 3, 1, 3)
    before = layer.clone()
    K.scatter(chunk, "vllm_flash_attn", [999, 5, 5], [layer], skip=3)  # nothing moves
    assert torch.equal(layer, before)
    K.scatter(chunk, "vllm_flash_attn", [999, 5, 6], [layer], skip=1)  # 999 is in the prefix
    assert torch.equal(layer[:, 1, 1], chunk[0, :, 1]) and torch.equal(layer[:, 1, 2], chunk[0, :, 2])


def test_gather_accepts_repeated_slots():
    layer = torch.randn(2, 2, 4, 1, 3)
    out = torch.empty(1, 2, 2, 1, 3)
    K.gather([layer], "vllm_flash_attn", [5, 5], out)
    assert torch.equal(out[0, :, 0], out[0, :, 1])


def test_check_slots_false_skips_the_host_check():
    layer = torch.randn(2, 2, 4, 1, 3)
    out = torch.empty(1, 2, 2, 1, 3)
    K.gather([layer], "vllm_flash_attn", [1, 2], out, check_slots=False)
    assert torch.equal(out[0, :, 1], layer[:, 0, 2])


def test_requires_grad_inputs_are_fine():
    layer = torch.randn(2, 2, 4, 1, 3, requires_grad=True)
    out = torch.empty(1, 2, 2, 1, 3)
    K.gather([layer], "vllm_flash_attn", [1, 2], out)
    assert torch.equal(out[0, :, 0], layer.detach()[:, 0, 1])


# --------------------------------------------------------------------------- errors
def _fa(nb=2, bs=4, h=1, d=3, dtype=torch.float32):
    return torch.zeros(2, nb, bs, h, d, dtype=dtype)


ERRORS = [
    ("unknown layout", lambda: K.gather([_fa()], "nope", [0], torch.empty(1, 2, 1, 1, 3)), "unknown KV layout 'nope'"),
    (
        "K/V axis",
        lambda: K.gather([torch.zeros(3, 2, 4, 1, 3)], "vllm_flash_attn", [0], torch.empty(1, 2, 1, 1, 3)),
        "must have length 2",
    ),
    (
        "layer axes",
        lambda: K.gather([torch.zeros(2, 4, 1, 3)], "vllm_flash_attn", [0], torch.empty(1, 2, 1, 1, 3)),
        "expects 5 axes",
    ),
    (
        "one layer to gather",
        lambda: K.gather(_fa(), "vllm_flash_attn", [0], torch.empty(1, 2, 1, 1, 3)),
        "gather_layer",
    ),
    ("no layers", lambda: K.gather([], "vllm_flash_attn", [0], torch.empty(1, 2, 1, 1, 3)), "empty"),
    (
        "layers differ",
        lambda: K.gather([_fa(), _fa(nb=3)], "vllm_flash_attn", [0], torch.empty(2, 2, 1, 1, 3)),
        r"paged_layers\[1\].*all layers must match",
    ),
    (
        "chunk shape",
        lambda: K.gather([_fa()], "vllm_flash_attn", [0, 1], torch.empty(1, 2, 3, 1, 3)),
        r"out has shape \(1, 2, 3, 1, 3\).*need \(1, 2, 2, 1, 3\)",
    ),
    (
        "chunk layers",
        lambda: K.scatter(torch.empty(2, 2, 1, 1, 3), "vllm_flash_attn", [0], [_fa()]),
        r"chunk has shape",
    ),
    (
        "chunk dtype",
        lambda: K.gather([_fa()], "vllm_flash_attn", [0], torch.empty(1, 2, 1, 1, 3, dtype=torch.float16)),
        "never convert",
    ),
    (
        "layer chunk shape",
        lambda: K.gather_layer(_fa(), "vllm_flash_attn", [0], torch.empty(1, 2, 1, 1, 3)),
        r"num_kv, num_tokens, heads, head_size",
    ),
    (
        "slot range",
        lambda: K.gather([_fa()], "vllm_flash_attn", [0, 8], torch.empty(1, 2, 2, 1, 3)),
        r"slot_mapping\[1\] = 8 is out of range.*8 slots",
    ),
    (
        "slot range scatter",
        lambda: K.scatter(torch.empty(1, 2, 1, 1, 3), "vllm_flash_attn", [100], [_fa()]),
        "out of range",
    ),
    (
        "slot range layer",
        lambda: K.scatter_layer(torch.empty(2, 1, 1, 3), "vllm_flash_attn", [8], _fa()),
        "out of range",
    ),
    (
        "duplicate slots",
        lambda: K.scatter(torch.empty(1, 2, 3, 1, 3), "vllm_flash_attn", [1, 4, 1], [_fa()]),
        "slot 1 appears more than once",
    ),
    (
        "slots 2-D",
        lambda: K.gather([_fa()], "vllm_flash_attn", torch.zeros(1, 1, dtype=torch.long), torch.empty(1, 2, 1, 1, 3)),
        "must be 1-D",
    ),
    (
        "slots float",
        lambda: K.gather([_fa()], "vllm_flash_attn", torch.zeros(1), torch.empty(1, 2, 1, 1, 3)),
        "must hold integers",
    ),
    (
        "skip range",
        lambda: K.gather([_fa()], "vllm_flash_attn", [0], torch.empty(1, 2, 1, 1, 3), skip=2),
        r"skip=2 is outside \[0, 1\]",
    ),
    (
        "skip type",
        lambda: K.gather([_fa()], "vllm_flash_attn", [0], torch.empty(1, 2, 1, 1, 3), skip=True),
        "skip must be an int",
    ),
    (
        "paged type",
        lambda: K.gather("x", "vllm_flash_attn", [0], torch.empty(1, 2, 1, 1, 3)),
        "must be a tensor or a list",
    ),
]


@pytest.mark.parametrize("name,call,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_arguments_raise_a_clear_value_error(name, call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_slot_errors_are_slot_mapping_errors():
    with pytest.raises(K.SlotMappingError):
        K.gather([_fa()], "vllm_flash_attn", [9], torch.empty(1, 2, 1, 1, 3))


# --------------------------------------------------------------------------- layouts
def test_every_builtin_layout_is_registered_and_described():
    assert set(BUILTIN) <= set(K.LAYOUTS)
    assert get_layout("flashinfer_hnd").describe_shape() == "(num_blocks, 2, num_kv_heads, block_size, head_size)"
    assert get_layout("mla").describe_shape() == "(num_blocks, block_size, latent_size)"
    assert get_layout("contiguous").describe_shape() == "(2, num_tokens, num_kv_heads, head_size)"
    assert get_layout(K.MLA) is K.MLA


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(offset_axis=0, dim_axis=0), "distinct"),
        (dict(offset_axis=0, dim_axis=2), "cover 0..1"),
        (dict(offset_axis=0, dim_axis=1, kv_axis=True), "must be an int"),
    ],
)
def test_invalid_layouts_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVLayout("bad", **kwargs)


def test_registering_a_clashing_name_fails_naming_both():
    register_layout(ODD)  # the same object again: fine
    other = KVLayout("test_odd_hbokd", offset_axis=0, dim_axis=1)
    with pytest.raises(ValueError, match="already registered as 'test_odd_hbokd'"):
        register_layout(other)
    assert K.LAYOUTS["test_odd_hbokd"] == ODD


def test_canonical_is_a_view():
    t = torch.zeros(4, 2, 3, 5, 6)  # flashinfer_hnd: (blocks, 2, heads, bs, dim)
    c = get_layout("flashinfer_hnd").canonical(t)
    assert c.shape == (2, 4, 5, 3, 6)
    c[1, 2, 4, 0, 5] = 1.0
    assert t[2, 1, 0, 4, 5] == 1.0


# --------------------------------------------------------------------------- backends
def test_importing_kernels_does_not_import_triton():
    code = "import sys, lmcache.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_backend_selection(monkeypatch):
    from lmcache.kernels import ops

    assert K.select_backend(torch.device("cpu")) == "torch"
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    assert K.select_backend(torch.device("cuda", 0)) == "triton"
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    assert K.select_backend(torch.device("cuda", 0)) == "torch"
    with pytest.raises(ImportError, match="pip install triton"):
        K.select_backend(torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="unknown kernels backend"):
        K.select_backend(torch.device("cpu"), "cuda")
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        K.select_backend(torch.device("cpu"), "triton")


def _triton_or_skip() -> None:
    probe = subprocess.run(
        [sys.executable, "-c", "import triton, triton.language"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        msg = f"triton is not importable ({last}); the Triton kernels are untested (pip install triton)"
        from _missing import missing  # (this file also runs in a subprocess without tests/ on its path)

        missing(msg)


def _triton_interpreter_check() -> None:
    """Run in a child with TRITON_INTERPRET=1: Triton must equal the torch reference."""
    import itertools

    gen = torch.Generator().manual_seed(7)
    dtypes = itertools.cycle(DTYPES)
    n = 0
    for name in BUILTIN + (ODD.name,):
        lay = get_layout(name)
        for storage in STORAGES:
            dtype = next(dtypes)
            layers = make_layers(lay, 2, 3, 2, 2, 3, dtype, storage, gen)
            cap = 6
            slots = torch.randperm(cap, generator=gen)[:5]
            slots[2] = -1
            skip = n % 3
            shape = K.chunk_shape(layers, lay, 5)
            out_t = random_bits(shape, dtype, gen)
            out_r = out_t.clone()
            K.gather(layers, lay, slots, out_t, skip, backend="triton")
            K.gather(layers, lay, slots, out_r, skip, backend="torch")
            assert torch.equal(bits(out_t), bits(out_r)), (name, storage, dtype, "gather")
            a, b = clone_layers(layers), clone_layers(layers)
            K.scatter(out_t, lay, slots, a, skip, backend="triton")
            K.scatter(out_t, lay, slots, b, skip, backend="torch")
            assert all(torch.equal(bits(x), bits(y)) for x, y in zip(as_list(a), as_list(b))), (
                name,
                storage,
                dtype,
                "scatter",
            )
            one = as_list(layers)[1]
            lt = random_bits(shape[1:], dtype, gen)
            lr = lt.clone()
            K.gather_layer(one, lay, slots, lt, skip, backend="triton")
            K.gather_layer(one, lay, slots, lr, skip, backend="torch")
            assert torch.equal(bits(lt), bits(lr)), (name, storage, dtype, "gather_layer")
            c, d = one.clone(), one.clone()
            K.scatter_layer(lt, lay, slots, c, skip, backend="triton")
            K.scatter_layer(lt, lay, slots, d, skip, backend="torch")
            assert torch.equal(bits(c), bits(d)), (name, storage, dtype, "scatter_layer")
            n += 1
    # layers with different strides take one launch each
    mixed = [torch.zeros(2, 3, 2, 2, 3), torch.zeros(3, 2, 2, 3, 2).permute(2, 0, 1, 4, 3)]
    chunk = random_bits((2, 2, 4, 2, 3), torch.float32, gen)
    K.scatter(chunk, "vllm_flash_attn", [0, 5, 3, 1], mixed, backend="triton")
    back = torch.zeros_like(chunk)
    K.gather(mixed, "vllm_flash_attn", [0, 5, 3, 1], back)
    assert torch.equal(bits(back), bits(chunk))
    print(f"triton interpreter: {n} cases x 4 ops match the torch reference")


def test_triton_kernels_match_reference_in_interpreter_mode():
    _triton_or_skip()
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    code = f"import runpy; runpy.run_path({str(Path(__file__))!r})['_triton_interpreter_check']()"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "match the torch reference" in r.stdout


def test_triton_kernel_compiles_for_hopper_and_ampere():
    """No GPU needed: lower the kernel to PTX and a cubin for sm_90 and sm_80."""
    _triton_or_skip()
    code = textwrap.dedent(
        """
        import re
        from lmcache.kernels import triton_kernels as tk
        for arch in (90, 80):
            for gather in (True, False):
                k = tk.compile_for(arch, gather=gather)
                ops = set(re.findall(r"(?:ld|st)\\.global\\.v4\\.b32", k.asm["ptx"]))
                assert k.asm["cubin"], arch
                assert ops == {"ld.global.v4.b32", "st.global.v4.b32"}, (arch, ops)  # 16-byte accesses
        print("compiled")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    if r.returncode != 0 and "ptxas" in (r.stderr or "") and "not found" in r.stderr.lower():
        msg = "triton's bundled ptxas is unavailable here: " + r.stderr.strip().splitlines()[-1]
        from _missing import missing  # (this file also runs in a subprocess without tests/ on its path)

        missing(msg)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compiled" in r.stdout


# --------------------------------------------------------------------------- bench
def test_bench_measure_reports_rates():
    from lmcache.kernels.bench import measure

    r = measure("flashinfer_hnd", 32, num_layers=2, num_heads=2, head_size=16, block_size=4, repeat=2)
    assert r["layout"] == "flashinfer_hnd" and r["backend"] == "torch"
    assert r["bytes"] == 2 * 2 * 32 * 2 * 16 * 2
    for key in ("gather_gbps", "scatter_gbps", "memcpy_gbps"):
        assert r[key] > 0
