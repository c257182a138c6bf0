"""Checkpoints against independent readers: the safetensors package's and torch's readers of
what jaxquant writes, NumPy references of the packed byte layouts, hand-made hostile files,
and round trips compared bit for bit (NaN payloads and -0.0 included)."""

import json
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
from host_mesh import host_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant._checkpoint import load_orbax, load_safetensors, save_orbax, save_safetensors

_RNG = np.random.default_rng(7)
_X = _RNG.standard_normal((5, 37)).astype(np.float32)
_X[0, :4] = [np.nan, -0.0, np.inf, -np.inf]
_X = jnp.asarray(_X)


def _is_packed(x):
    return isinstance(x, jq.PackedArray)


def _bits(tree) -> list:
    """Each leaf's path, type, dtype, shape and raw bytes, and each record's static metadata."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_packed)[0]
    out = []
    for path, x in flat:
        meta = (x.dtype, x.shape, x.axis, x.bits) if _is_packed(x) else ()
        data = x.data if _is_packed(x) else x
        out.append((jax.tree_util.keystr(path), type(x).__name__, np.dtype(data.dtype).name,
                    tuple(data.shape), np.asarray(data).tobytes(), meta))
    records = [(q.axis, q.block_size, np.dtype(q.dtype).name, q.codebook, q.packed)
               for q in jax.tree.leaves(tree, is_leaf=jq.is_qtensor) if jq.is_qtensor(q)]
    return out + records


def _codes(dtype, shape, below=None):
    """Random codes: every bit pattern of ``dtype`` (NaN, inf, -0.0 of floats), or ``< below``."""
    n = int(np.prod(shape))
    if below is not None:
        return jnp.asarray(_RNG.integers(0, below, n).astype(dtype).reshape(shape))
    bits = jq.FORMATS[np.dtype(dtype).name].bits if np.dtype(dtype).name in jq.FORMATS else 8
    if bits < 8:
        uint = {2: ml_dtypes.uint2, 4: ml_dtypes.uint4}[bits]
        return jnp.asarray(_RNG.integers(0, 2**bits, n).astype(uint).view(dtype).reshape(shape))
    return jnp.asarray(np.frombuffer(_RNG.bytes(n * np.dtype(dtype).itemsize), dtype)
                       .reshape(shape))


def _mixed_tree():
    """The layouts of the schemes (MX e8m0 block scales, NVFP4's two-level scales, float6
    codebooks), NF4 packed, float6 packed along axis 0, double quantization, tiles with zero
    points, bfloat16/float16 records, a negative axis, 0-d and empty QTensors, and plain leaves in lists and
    tuples with None: odd lengths (partial blocks and bytes), every code bit pattern, scales
    with NaN payloads and -0.0. Built from codes (no quantize compiles)."""
    f32 = lambda *s: _codes(np.float32, s)  # noqa: E731
    e8m0 = _codes(ml_dtypes.float8_e8m0fnu, (5, 2))
    fp4 = ml_dtypes.float4_e2m1fn
    return {
        "mxfp4": jq.QTensor(_codes(fp4, (5, 37)), e8m0, axis=1, block_size=32),
        "nvfp4": jq.QTensor(_codes(fp4, (5, 37)), jq.QTensor(
            _codes(ml_dtypes.float8_e4m3fn, (5, 3)), f32()), axis=1, block_size=16),
        "mxfp6": jq.QTensor(_codes(np.uint8, (5, 37), 64), e8m0, axis=1, block_size=32,
                            codebook="float6_e3m2fn"),
        "nf4_packed": jq.pack(jq.QTensor(_codes(ml_dtypes.uint4, (5, 37)), f32(5, 1), axis=1,
                                         block_size=64, codebook="nf4")),
        "f6_axis0": jq.pack(jq.QTensor(_codes(np.uint8, (5, 37), 64), f32(3, 37), axis=0,
                                       block_size=2, codebook="float6_e2m3fn"), axis=0),
        "dq": jq.QTensor(_codes(jnp.int4, (5, 37)), jq.QTensor(
            _codes(np.uint8, (5, 5)), f32(5), _codes(np.uint8, (5,)), axis=0), axis=1,
            block_size=8),
        "tiles_zp": jq.QTensor(_codes(ml_dtypes.uint2, (5, 37)), f32(3, 3),
                               _codes(ml_dtypes.uint2, (3, 3)), block_size=(2, 16)),
        "bf16": jq.QTensor(_codes(np.int8, (5, 37)), _codes(ml_dtypes.bfloat16, (5,)), axis=0,
                           dtype=jnp.bfloat16),
        "f16": jq.QTensor(_codes(ml_dtypes.float8_e5m2, (5, 37)), _codes(np.float16, (3, 37)),
                          axis=0, block_size=2, dtype=jnp.float16),
        "neg_axis": jq.QTensor(_codes(np.int8, (5, 37)), f32(37), axis=-1),
        "scalar": jq.QTensor(_codes(jnp.int4, ()), jnp.float32(-0.0)),
        "empty": jq.QTensor(_codes(ml_dtypes.uint4, (0, 3)), f32(3),
                            _codes(ml_dtypes.uint4, (3,)), axis=1),
        "plain": [{"nan": jnp.asarray(np.array([0x7FC00001, 0xFFBFFFFF, 0x80000000],
                                               np.uint32).view(np.float32)), "none": None},
                  (jnp.zeros((2, 0), jnp.bfloat16), jnp.asarray(np.float16(-0.0)))],
    }


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tree = _mixed_tree()
    path = str(tmp_path_factory.mktemp("mixed") / "m.safetensors")
    save_safetensors(path, tree)
    return tree, path


# --- bugs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("save", [save_safetensors, save_orbax])
def test_float6_codes_of_64_or_more_are_refused_at_save(tmp_path, save):
    """Unpacked float6 codebook codes are stored four in three bytes: a uint8 code of 200 put
    its two high bits into the next code's field, so a neighbouring 0 came back as 3 (0.375
    instead of 0.0 after dequantization), silently."""
    codes = jnp.array([[200, 0, 0, 0, 5]], jnp.uint8)  # traced: past the constructor's check
    bad = {"q": jax.jit(lambda c: jq.QTensor(c, jnp.float32(1.0), codebook="float6_e2m3fn"))(
        codes)}
    with pytest.raises(ValueError, match=r"'q/qvalue': float6_e2m3fn codes are 6-bit indices "
                                         r"\(0 to 63\), got a code 200"):
        save(tmp_path / "bad", bad)
    assert not (tmp_path / "bad").exists()
    good = {"q": jq.QTensor(jnp.array([[63, 0, 17, 1, 5]], jnp.uint8), jnp.float32(1.0),
                            codebook="float6_e2m3fn")}
    save(tmp_path / "good", good)
    load = load_safetensors if save is save_safetensors else load_orbax
    assert _bits(load(tmp_path / "good", good)) == _bits(good)


def test_empty_float6_codes_load_into_a_packed_target(tmp_path):
    """Zero-size float6 codes were stored unpacked (every other size packed): a packed target
    (what quantize(..., packed=True) gives) was refused with 'packed axis mismatch: the
    target expects 1, the file holds None'."""
    for shape in ((0, 4), (4, 0)):
        x = jnp.zeros(shape)
        saved = {"q": jq.quantize(x, dtype="float6_e2m3fn", axis=None)}
        target = jax.eval_shape(lambda x=x: {"q": jq.quantize(x, dtype="float6_e2m3fn",
                                                              axis=None, packed=True)})
        save_safetensors(tmp_path / "m", saved)
        back = load_safetensors(tmp_path / "m", target)
        assert back["q"].packed and back["q"].shape == shape
        assert _bits(jq.unpack(back["q"])) == _bits(saved["q"])
        assert _bits(load_safetensors(tmp_path / "m")) == _bits(saved)
        (tmp_path / "m").unlink()


def test_tree_key_reserved_by_safetensors_is_refused_at_save(tmp_path):
    """A top-level leaf named "__metadata__" was written as a tensor of that name, which the
    safetensors header uses for the metadata: the file (replacing any file at the path) could
    not be read back ('duplicate field `__metadata__`'), the data lost."""
    path = tmp_path / "m.safetensors"
    with pytest.raises(ValueError, match="tree key '__metadata__': safetensors reserves"):
        save_safetensors(path, {"__metadata__": jnp.ones(3), "w": jnp.zeros(2)})
    assert not path.exists()
    nested = {"a": {"__metadata__": jnp.arange(3.0)}, "__metadata__": {"b": jnp.ones(2)}}
    save_safetensors(path, nested)
    assert _bits(load_safetensors(path)) == _bits(nested)


@pytest.mark.parametrize("explicit", [False, True])
def test_orbax_bitcast_tensor_onto_a_sharded_target_under_set_mesh(tmp_path, explicit):
    """A dtype stored bitcast (float8_e3m4 as U8) was restored onto one device and cast
    there: under `jax.set_mesh` that cast raised XLA's 'Received incompatible devices for
    jitted computation'."""
    codes = np.frombuffer(_RNG.bytes(64), ml_dtypes.float8_e3m4).reshape(8, 8)
    tree = {"e3m4": jnp.asarray(codes), "f": jnp.ones((8, 2))}
    save_orbax(tmp_path / "c", tree)
    mesh = host_mesh((2, 4), ("a", "b"), AxisType.Explicit if explicit else None)
    where = mesh.abstract_mesh if explicit else mesh
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(where, P("a")))
              for k, v in tree.items()}
    with jax.set_mesh(mesh):
        back = load_orbax(tmp_path / "c", target)
    assert np.asarray(back["e3m4"]).tobytes() == codes.tobytes()
    assert back["e3m4"].dtype == ml_dtypes.float8_e3m4
    assert back["e3m4"].sharding.spec == P("a") and len(back["e3m4"].addressable_shards) == 8


@pytest.mark.parametrize("explicit", [True, False])
def test_orbax_without_a_target_under_set_mesh(tmp_path, explicit):
    """Tensors no target places were restored committed to one device: packed codes then
    reached a jit under `jax.set_mesh` ('Received incompatible devices'), and plain leaves
    refused every later op in that context. They come back as from a file: uncommitted."""
    tree = {"w": jq.quantize(jnp.asarray(_RNG.standard_normal((8, 8)), jnp.float32),
                             dtype=jnp.int4), "b": jnp.arange(8.0)}
    save_orbax(tmp_path / "c", tree)
    mesh = host_mesh((2, 4), ("a", "b"), AxisType.Explicit if explicit else None)
    with jax.set_mesh(mesh):
        for target in (None, jax.tree.map(np.asarray, tree)):
            back = load_orbax(tmp_path / "c", target)
            assert float(jnp.sum(back["b"])) == 28.0  # usable in the mesh's context
            np.testing.assert_array_equal(jq.dequantize(back["w"]), jq.dequantize(tree["w"]))
            assert back["w"].qvalue.dtype == jnp.int4


@pytest.mark.parametrize("saved, wanted", [(jnp.int4, jnp.uint4), (jnp.uint8, jnp.int8),
                                           (jnp.int8, jnp.uint8)])
def test_signed_against_unsigned_codes_is_a_dtype_mismatch(tmp_path, saved, wanted):
    """Unsigned codes come with a zero point: the zero point's check came first and called
    an int4 file under a uint4 target a missing zero point, a ValueError."""
    x = jnp.linspace(-1, 1, 32).reshape(4, 8)
    save_safetensors(tmp_path / "q.safetensors", {"w": jq.quantize(x, dtype=saved)})
    target = {"w": jax.eval_shape(lambda: jq.quantize(x, dtype=wanted))}
    message = (f"'w/qvalue': dtype mismatch: the target expects {jnp.dtype(wanted).name}, "
               f"the file holds {jnp.dtype(saved).name}")
    with pytest.raises(TypeError, match=message):
        load_safetensors(tmp_path / "q.safetensors", target)


def _hand_written(path, entries: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(entries).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def test_safetensors_layout_errors_name_the_tensor(tmp_path):
    """safetensors refuses offsets that overlap or leave the file, and dtypes or shapes that do
    not fit their bytes, with 'invalid shape, data type, or offset for tensor' (no name)."""
    meta = {"__metadata__": {"k": "v"}}
    a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    b = {"dtype": "I16", "shape": [3], "data_offsets": [8, 14]}
    path = tmp_path / "h.safetensors"
    data = bytes(range(14))
    _hand_written(path, meta | {"a": a, "b": b}, data)
    plain = load_safetensors(path, allow_plain=True)
    assert np.asarray(plain["b"]).tobytes() == data[8:]  # the undamaged file loads
    cases = [
        ({"a": a, "b": b | {"data_offsets": [6, 12]}}, data[:12],
         r"tensor 'b': its data_offsets \[6, 12\] start at byte 6, the previous tensor's data "
         r"ends at byte 8"),
        ({"a": a, "b": b | {"data_offsets": [8, 10**6]}}, data,
         r"tensor 'b': I16\[3\] is 6 bytes, its data_offsets \[8, 1000000\] hold 999992"),
        ({"a": a | {"shape": [3]}, "b": b}, data, r"tensor 'a': F32\[3\] is 12 bytes"),
        ({"a": a | {"dtype": "F16"}, "b": b}, data, r"tensor 'a': F16\[2\] is 4 bytes"),
        ({"a": a, "b": b}, data[:11], r"tensor 'b': its data_offsets \[8, 14\] run past the "
                                      r"11 bytes of data in the file"),
        ({"a": a, "b": b}, data + b"\0" * 5, r"5 bytes after the last tensor's data"),
    ]
    for entries, raw, message in cases:
        _hand_written(path, meta | entries, raw)
        for allow_plain in (False, True):
            with pytest.raises(ValueError, match="not a valid safetensors file.*" + message):
                load_safetensors(path, allow_plain=allow_plain)
    _hand_written(path, meta | {"a": a, "b": b}, data, length=10**6)
    with pytest.raises(ValueError, match="its header length field says 1000000 bytes"):
        load_safetensors(path)


# --- verified behaviour ---------------------------------------------------------------------


def test_mixed_tree_round_trips_bit_for_bit(mixed, tmp_path):
    """`_mixed_tree` bit for bit into no target, the tree itself and `jax.eval_shape`'s
    abstract tree (safetensors), and the abstract tree (orbax)."""
    tree, path = mixed
    want = _bits(tree)
    abstract = jax.eval_shape(lambda: tree)
    assert _bits(load_safetensors(path, tree)) == want
    assert _bits(load_safetensors(path, abstract)) == want
    flat = load_safetensors(path)  # nested dicts: lists and tuples come back keyed "0", "1"
    assert _bits(flat["plain"]["0"]["nan"]) == _bits(tree["plain"][0]["nan"])
    records = [k for k in tree if k != "plain"]
    assert _bits([flat[k] for k in records]) == _bits([tree[k] for k in records])
    save_orbax(tmp_path / "c", tree)
    assert _bits(load_orbax(tmp_path / "c", abstract)) == want


def _ref_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """The packed bytes of unsigned ``bits``-bit fields along the last axis, written from the
    layout: field ``i`` of a group is bits ``[bits * i, bits * (i + 1))`` of the group's
    little-endian integer (ONNX's layout for 2 and 4 bits; 4 codes in 3 bytes for 6)."""
    per, width = (4, 3) if bits == 6 else (8 // bits, 1)
    n = codes.shape[-1]
    padded = np.zeros(codes.shape[:-1] + (-(-n // per) * per,), np.uint64)
    padded[..., :n] = codes
    groups = padded.reshape(codes.shape[:-1] + (-1, per))
    value = sum(groups[..., i] << np.uint64(bits * i) for i in range(per))
    out = np.stack([(value >> np.uint64(8 * j)) & np.uint64(255) for j in range(width)], -1)
    return out.reshape(codes.shape[:-1] + (-1,)).astype(np.uint8)


def test_written_file_is_standard_safetensors(mixed):
    """The file by the spec (8-byte length, JSON object padded to 8 bytes, data_offsets
    contiguous from 0 to the end of the file, str -> str metadata), read by torch's
    `safetensors.torch.load_file` and `safe_open`: dtype codes as documented, plain leaves'
    bytes as saved, packed codes as the NumPy reference packs them."""
    tree, path = mixed
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8:9] == b"{"
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__")
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    end = 0
    for entry in sorted(header.values(), key=lambda e: e["data_offsets"]):
        assert entry["data_offsets"][0] == end
        end = entry["data_offsets"][1]
    assert end == len(raw) - 8 - n
    dtypes = {k: v["dtype"] for k, v in header.items()}
    assert dtypes["mxfp4/scale"] == dtypes["mxfp6/scale"] == "F8_E8M0"
    assert dtypes["nvfp4/scale/qvalue"] == "F8_E4M3" and dtypes["f16/qvalue"] == "F8_E5M2"
    assert dtypes["mxfp4/qvalue"] == dtypes["nf4_packed/qvalue"] == "U8"
    assert dtypes["tiles_zp/zero_point"] == dtypes["dq/scale/zero_point"] == "U8"
    assert dtypes["bf16/scale"] == dtypes["plain/1/0"] == "BF16" and dtypes["f16/scale"] == "F16"
    assert dtypes["scalar/qvalue"] == "U8" and header["scalar/qvalue"]["shape"] == [1]

    by_torch = safetensors.torch.load_file(path)
    assert set(by_torch) == set(header)

    def stored(name):
        t = by_torch[name].contiguous()
        return t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() \
            else b""

    assert stored("plain/0/nan") == np.asarray(tree["plain"][0]["nan"]).tobytes()
    assert stored("f16/qvalue") == np.asarray(tree["f16"].qvalue).tobytes()
    assert stored("mxfp4/scale") == np.asarray(tree["mxfp4"].scale).tobytes()
    assert stored("nvfp4/scale/scale") == np.asarray(tree["nvfp4"].scale.scale).tobytes()
    u4 = np.asarray(tree["nvfp4"].qvalue).view(np.uint8) & 15  # float4 bit patterns
    assert stored("nvfp4/qvalue") == _ref_pack(u4, 4).tobytes()
    assert stored("mxfp6/qvalue") == _ref_pack(np.asarray(tree["mxfp6"].qvalue), 6).tobytes()
    u2 = np.asarray(tree["tiles_zp"].zero_point).astype(np.uint8)
    assert stored("tiles_zp/zero_point") == _ref_pack(u2, 2).tobytes()
    assert tuple(by_torch["mxfp6/qvalue"].shape) == (5, 30)  # 37 codes: 10 groups of 3 bytes
    with safetensors.safe_open(path, framework="np") as f:
        assert f.metadata() == meta
        assert f.get_tensor("dq/scale/scale").tobytes() == np.asarray(
            tree["dq"].scale.scale).tobytes()


def test_plain_safetensors_files_load_with_allow_plain_only(tmp_path):
    """Files that `safetensors.numpy.save_file` and `safetensors.torch.save_file` write (no
    jaxquant header): refused without ``allow_plain``, with it every tensor bit for bit."""
    import torch

    path = tmp_path / "p.safetensors"
    arrays = {"x/w": np.arange(6, dtype=np.float32).reshape(2, 3), "x/b": np.array([-0.0]),
              "i": np.array([2**40], np.int64), "e": np.zeros((0, 2), np.uint16)}
    safetensors.numpy.save_file(arrays, str(path), metadata={"format": "np"})
    with pytest.raises(ValueError, match="no 'jaxquant' entry in the metadata"):
        load_safetensors(path)
    back = load_safetensors(path, allow_plain=True)
    got = [back["x"]["w"], back["x"]["b"], back["i"], back["e"]]
    for x, want in zip(got, arrays.values(), strict=True):
        assert (x.dtype, x.shape, np.asarray(x).tobytes()) == (want.dtype, want.shape,
                                                                want.tobytes())
    tensors = {"f8": torch.tensor([1.0, -0.0, 448.0, float("nan")]).to(torch.float8_e4m3fn),
               "e8m0": torch.tensor([1.0, 2.0**-127, 0.5]).to(torch.float8_e8m0fnu),
               "bf16": torch.tensor([1.5, -0.0, float("nan")]).to(torch.bfloat16),
               "u64": torch.tensor([2**63 + 5], dtype=torch.uint64)}
    safetensors.torch.save_file(tensors, str(path))
    back = load_safetensors(path, allow_plain=True)
    for name, t in tensors.items():
        assert np.asarray(back[name]).tobytes() == t.view(torch.uint8).numpy().tobytes(), name
        assert np.dtype(back[name].dtype).name == {
            "f8": "float8_e4m3fn", "e8m0": "float8_e8m0fnu", "bf16": "bfloat16",
            "u64": "uint64"}[name]


def test_abstract_targets_that_differ_name_the_path(mixed):
    """Abstract targets (`jax.eval_shape`, ShapeDtypeStructs with shardings on 8 devices)
    whose structure, shapes, dtypes or granularity differ: errors that name the path."""
    tree, path = mixed
    mesh = host_mesh((8,), ("x",))
    abstract = jax.eval_shape(lambda: tree)
    mx, dq, bf16 = tree["mxfp4"], tree["dq"], tree["bf16"]
    other = {  # what the target holds instead of the file's leaf
        "bf16": lambda: jq.QTensor(bf16.qvalue, bf16.scale, axis=0),
        "mxfp4": lambda: jq.QTensor(mx.qvalue, mx.scale.astype(jnp.float32), axis=1,
                                    block_size=32),
        "f16": lambda: jq.QTensor(jnp.zeros((5, 36), jnp.float8_e5m2),
                                  jnp.zeros((3, 36), jnp.float16), axis=0, block_size=2,
                                  dtype=jnp.float16),
        "dq": lambda: jq.QTensor(dq.qvalue, jnp.zeros((5, 5)), axis=1, block_size=8),
        "nf4_packed": lambda: jq.unpack(tree["f6_axis0"]),
    }
    cases = [
        ({**abstract, "extra": jax.ShapeDtypeStruct((2,), jnp.float32)}, ValueError,
         "key 'extra' of the target is missing from the file"),
        ({k: v for k, v in abstract.items() if k != "dq"}, ValueError,
         "unexpected key 'dq' in the file"),
        ("bf16", TypeError, "'bf16': QTensor dtype mismatch: the target expects float32, the "
                            "file holds bfloat16"),
        ("mxfp4", TypeError, "'mxfp4/scale': dtype mismatch: the target expects float32, the "
                             "file holds float8_e8m0fnu"),
        ("f16", ValueError, r"'f16/qvalue': shape mismatch: the target expects \(5, 36\), the "
                            r"file holds \(5, 37\)"),
        ("dq", TypeError, "'dq': the target has an array scale, the file a QTensor scale"),
        ("nf4_packed", ValueError, "'nf4_packed': QTensor axis mismatch: the target expects 0, "
                                   "the file holds 1"),
        ({**abstract, "plain": [abstract["plain"][0], (abstract["plain"][1][0],)]}, ValueError,
         "unexpected key 'plain/1/1' in the file"),
    ]
    for target, error, message in cases:
        if isinstance(target, str):
            target = {**abstract, target: jax.eval_shape(other[target])}
        with pytest.raises(error, match=message):
            load_safetensors(path, target)
    uneven = {**abstract, "plain": [{"nan": jax.ShapeDtypeStruct(
        (3,), jnp.float32, sharding=NamedSharding(mesh, P("x")))}, abstract["plain"][1]]}
    with pytest.raises(ValueError, match=r"'plain/0/nan': the target's sharding .* does not "
                                         r"split its shape \(3,\) into equal shards"):
        load_safetensors(path, uneven)
