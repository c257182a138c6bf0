"""Seeded fuzzing of checkpoints: damaged bytes, and headers edited with a recomputed CRC-32.

Every outcome must be a bit-exact load or a ValueError / TypeError: no low-level exception
(XLA's, NumPy's, JSON's), and no tree that differs from the saved one where the file or the
target can tell. Headers are edited as a tool would (valid JSON, checksum recomputed), so
the CRC-32 cannot be what catches them.
"""

import copy
import json
import random

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import jaxquant as jq
from jaxquant._checkpoint import load_orbax, load_safetensors, save_orbax, save_safetensors
from jaxquant._serialization import _metadata_crc, encode, header_metadata


def _tree():
    """Many formats, with codes that are never zero (a dropped code would be seen), packed
    on both axes, odd lengths (partial bytes), a scalar and an empty array."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8)), jnp.float32)
    ones = lambda dtype, shape=(3, 8): jnp.ones(shape, dtype)  # noqa: E731
    half = jnp.float32(0.5)
    return {
        "i2": jq.QTensor(ones(jnp.int2), half),
        "i2p0": jq.pack(jq.QTensor(ones(jnp.int2, (7, 3)), half), axis=0),
        "u4": jq.QTensor(ones(jnp.uint4), jnp.full(8, 0.5), ones(jnp.uint4, (8,)) * 2, axis=1),
        "i4p": jq.pack(jq.QTensor(ones(jnp.int4), jnp.full((3, 2), 0.5), axis=1,
                                  block_size=4)),
        "fp4": jq.QTensor(ones(jnp.float4_e2m1fn), half),
        "nf4": jq.QTensor(ones(jnp.uint4) * 5, half, codebook="nf4"),
        "f6": jq.QTensor(ones(jnp.uint8) * 9, half, codebook="float6_e2m3fn"),
        "mx": jq.quantize(x + 3, dtype="mxfp4", packed=True),
        "nv": jq.quantize(x + 3, dtype="nvfp4"),
        "tile": jq.quantize(x, dtype=jnp.int8, block_size=(3, 4)),
        "f8": jq.quantize(x, dtype=jnp.float8_e5m2, axis=1),
        "odd": jq.pack(jq.QTensor(ones(jnp.int4, (2, 7)), half)),
        "weird/k.e y": {"ü": jnp.arange(3, dtype=jnp.int16), "": jnp.bfloat16(1.5)},
        "lst": [jnp.zeros((0, 2)), (jnp.float16(2),)],
        "e3m4": jnp.asarray(np.arange(5).astype(ml_dtypes.float8_e3m4)),
        "scalar_u2": jnp.asarray(np.array(1, ml_dtypes.uint2)),
    }


def _bits(tree) -> list:
    """Every leaf's type, dtype, shape and bytes, and every QTensor's metadata."""
    out = [(type(y).__name__, np.dtype(y.dtype).name, tuple(y.shape), np.asarray(y).tobytes())
           for y in jax.tree.leaves(tree)]
    return out + [(q.axis, q.block_size, np.dtype(q.dtype).name, q.codebook, q.packed)
                  for q in jax.tree.leaves(tree, is_leaf=jq.is_qtensor) if jq.is_qtensor(q)]


@pytest.fixture(scope="module")
def saved():
    tree = _tree()
    header, tensors = encode(tree, to_host=True)
    return tree, header, tensors


def _write(path, tensors, header):
    """The file of ``tensors`` with ``header``, its metadata checksum recomputed."""
    safetensors.numpy.save_file(tensors, path, metadata=header_metadata(header, None))


def _edit(header, where, value):
    h = copy.deepcopy(header)
    node = h
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    return h


# --- findings: each of these loaded (or crashed) before the fix -----------------------------


def test_tensor_of_a_dtype_jax_cannot_hold_is_a_malformed_header(tmp_path, saved):
    """A bitcast tensor whose header dtype is float6 (1 byte, as float8_e3m4) was viewed
    as float6 and handed to XLA, which raised its own JaxRuntimeError (jaxlib 0.11 aborts)."""
    _, header, tensors = saved
    path = tmp_path / "m.safetensors"
    _write(path, tensors, _edit(header, ("tensors", "e3m4", "dtype"), "float6_e2m3fn"))
    with pytest.raises(ValueError, match="malformed jaxquant header: dtype float6_e2m3fn has "
                                         "no JAX arrays"):
        load_safetensors(path)


@pytest.mark.parametrize("leaf", [("i2",), ("nv", "scale")])
def test_qtensor_dtype_jax_cannot_hold_is_a_malformed_header(tmp_path, saved, leaf):
    """A QTensor entry whose dequantization dtype is float6 loaded, and the QTensor failed
    later in XLA (JaxRuntimeError) when dequantized."""
    _, header, tensors = saved
    path = tmp_path / "m.safetensors"
    _write(path, tensors, _edit(header, ("leaves", *leaf, "dtype"), "float6_e3m2fn"))
    with pytest.raises(ValueError, match="malformed jaxquant header: the QTensor entry "
                                         f"'{leaf[0]}.*dtype='float6_e3m2fn'"):
        load_safetensors(path)


@pytest.mark.parametrize("name, shape", [
    ("i2/qvalue", [3, 7]), ("i2/qvalue", [3, 5]), ("i2p0/qvalue", [5, 3]),
    ("u4/qvalue", [3, 7]), ("u4/zero_point", [7]), ("i4p/qvalue", [3, 7]),
    ("fp4/qvalue", [3, 7]), ("nf4/qvalue", [3, 7]), ("f6/qvalue", [3, 5]),
    ("f6/qvalue", [3, 7]), ("mx/qvalue", [3, 7]), ("nv/qvalue", [3, 7]),
])
def test_packed_shape_edited_to_fewer_codes_is_refused(tmp_path, saved, name, shape):
    """Fewer codes that still fit the same packed bytes (8 int4 codes and 7 both take 4
    bytes) silently dropped the last codes: their nonzero bits are now a clear error."""
    _, header, tensors = saved
    path = tmp_path / "m.safetensors"
    h = _edit(header, ("tensors", name, "shape"), shape)
    _write(path, tensors, h)
    with pytest.raises(ValueError, match=f"tensor '{name}' holds nonzero bits past its "
                                         f"{shape[h['tensors'][name]['axis']]} codes"):
        load_safetensors(path)


def test_orbax_packed_shape_edited_to_fewer_codes_is_refused(tmp_path):
    tree = {"w": jq.QTensor(jnp.ones((2, 4), jnp.int4), jnp.float32(1))}
    save_orbax(tmp_path / "c", tree)
    meta_file = tmp_path / "c" / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    custom = meta["custom_metadata"]
    header = json.loads(custom["jaxquant"])
    header["tensors"]["w/qvalue"]["shape"] = [2, 3]
    custom["jaxquant"] = json.dumps(header, separators=(",", ":"))
    custom["jaxquant.crc32"] = _metadata_crc(custom)
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="'w/qvalue' holds nonzero bits past its 3 codes"):
        load_orbax(tmp_path / "c")


@pytest.mark.parametrize("save", [save_safetensors, save_orbax])
def test_packed_array_with_nonzero_padding_is_refused_at_save(tmp_path, save):
    """The loader refuses nonzero padding bits, so a hand-made PackedArray that has them is
    refused when saved, not written as a checkpoint that cannot be loaded back."""
    from jaxquant._packing import PackedArray

    bad = PackedArray(jnp.array([[0x21, 0xF3]], jnp.uint8), np.dtype(jnp.int4), (1, 3), 1)
    with pytest.raises(ValueError, match="'w': packed codes with nonzero bits past their 3 "
                                         "codes along axis 1"):
        save(tmp_path / "m", {"w": bad})
    save(tmp_path / "ok", {"w": jq.pack(jnp.array([[1, 2, 3]], jnp.int4))})


@pytest.mark.parametrize("save, load", [(save_safetensors, load_safetensors),
                                        (save_orbax, load_orbax)])
def test_prng_key_target_is_a_type_error_naming_the_leaf(tmp_path, save, load):
    """A target that holds a PRNG key (a model's rng) raised NumPy's bare "Cannot interpret
    'key<fry>' as a data type", naming neither the file nor the leaf."""
    save(tmp_path / "m", {"rng": jax.random.key_data(jax.random.key(0))})
    for key in (jax.random.key(0), jax.ShapeDtypeStruct((), jax.random.key(0).dtype)):
        with pytest.raises(TypeError, match=r"'rng': the target holds a PRNG key array "
                                            r"\(key<fry>\).*jax.random.wrap_key_data"):
            load(tmp_path / "m", {"rng": key})
    back = load(tmp_path / "m", {"rng": jax.random.key_data(jax.random.key(1))})
    assert jnp.array_equal(jax.random.wrap_key_data(back["rng"]), jax.random.key(0))


# --- seeded fuzzing --------------------------------------------------------------------------


_VALUES = [0, 1, -1, 2, 3, 7, 100, 2**40, None, "x", "", 1.5, float("nan"), True, False, [],
           {}, [1, 2], [0], [-1], [3, 8], [8, 3], [3, 7], [3, 0], "float32", "int4", "uint4",
           "uint8", "nf4", "fp4", "float6_e2m3fn", "float6_e3m2fn", "bfloat16",
           "float8_e8m0fnu", "raw", "packed", "bitcast", "qtensor", "array", "DELETE"]


def _locations(node, where=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*where, k)
            yield from _locations(v, (*where, k))
    elif isinstance(node, list):
        for i in range(len(node)):
            yield (*where, i)


def test_header_edits_with_a_recomputed_checksum_are_refused_or_exact(tmp_path, saved):
    """Seeded single-field edits anywhere in the header's leaves and tensors (and field
    insertions), checksum recomputed: a ValueError / TypeError, or a load; against the saved
    tree as target, a load is the saved tree bit for bit."""
    tree, header, tensors = saved
    path = tmp_path / "m.safetensors"
    rng = random.Random(0)
    places = [w for w in _locations(header) if w[0] in ("leaves", "tensors") and len(w) > 2]
    places += [(*w, f) for w in _locations(header) if w[0] == "leaves" and len(w) == 2
               for f in ("codebook", "scale", "bits")]
    loaded = 0
    for _ in range(500):
        where, value = rng.choice(places), rng.choice(_VALUES)
        h = copy.deepcopy(header)
        node = h
        for k in where[:-1]:
            node = node[k]
        if value == "DELETE":
            if isinstance(node, list) or where[-1] not in node:
                continue
            del node[where[-1]]
        else:
            node[where[-1]] = value
        _write(path, tensors, h)
        for target in (None, tree):
            try:
                back = load_safetensors(path, target)
            except (ValueError, TypeError):
                continue
            loaded += 1
            if target is not None:
                assert _bits(back) == _bits(tree), (where, value)
    assert loaded  # some edits are harmless (an unknown field, a per-tensor axis)


def test_damaged_bytes_are_refused(tmp_path):
    """Seeded bit flips in the header and the data, truncations at every 11th length and
    appended bytes: every one is a ValueError (the file's CRC-32s or safetensors' checks)."""
    path = tmp_path / "m.safetensors"
    save_safetensors(path, _tree())
    raw = path.read_bytes()
    rng = random.Random(1)
    damaged = []
    for _ in range(600):
        b = bytearray(raw)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        damaged.append(bytes(b))
    damaged += [raw[:n] for n in range(0, len(raw), 11)]
    damaged += [raw + extra for extra in (b"\0", b" " * 8, b"x" * 100, raw[:64])]
    for i, b in enumerate(damaged):
        path.write_bytes(b)
        with pytest.raises(ValueError):
            load_safetensors(path, allow_plain=bool(i % 2))


def test_round_trip_of_the_fuzzed_tree(tmp_path, saved):
    """The undamaged file (odd packed lengths, zero padding) loads back bit for bit."""
    tree, header, tensors = saved
    path = tmp_path / "m.safetensors"
    _write(path, tensors, header)
    assert _bits(load_safetensors(path, tree)) == _bits(tree)
    save_orbax(tmp_path / "c", tree)
    assert _bits(load_orbax(tmp_path / "c", tree)) == _bits(tree)
