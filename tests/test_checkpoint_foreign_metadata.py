"""Files that other tools rewrote: a jaxquant safetensors file re-saved by ``safetensors.torch``
with an added ``__metadata__`` entry (Hugging Face writes ``{"format": "pt"}``) loads, since the
checksum never covered that entry; a changed or removed entry, or a header whose leaves and
tensors disagree, is refused naming what is wrong."""

import json
import struct
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import jaxquant as jq

torch = pytest.importorskip("torch")
import safetensors.torch  # noqa: E402  (needs torch)


def _resave(path, change):
    """``path`` rewritten by safetensors' torch writer with ``change(metadata)``."""
    with safetensors.safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    safetensors.torch.save_file(tensors, path, metadata=change(dict(meta)))


def _tree():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    return {"w": jq.quantize(x, dtype=jnp.uint4, symmetric=False, axis=0), "b": x[0]}


@pytest.mark.parametrize("added", [{"format": "pt"}, {"format": "pt", "tool": "x", "v": "2"}])
def test_entries_added_after_saving_are_ignored(tmp_path, added):
    path = tmp_path / "m.safetensors"
    jq.save_safetensors(path, _tree(), metadata={"author": "me"})
    _resave(path, lambda m: m | added)
    back = jq.load_safetensors(path)
    np.testing.assert_array_equal(back["w"].qvalue, _tree()["w"].qvalue)
    np.testing.assert_array_equal(back["b"], _tree()["b"])


@pytest.mark.parametrize("change", [lambda m: m | {"author": "someone else"},
                                    lambda m: {k: v for k, v in m.items() if k != "author"},
                                    lambda m: m | {"author": "x", "format": "pt"}])
def test_a_saved_entry_changed_or_removed_is_corruption_listing_the_entries(tmp_path, change):
    path = tmp_path / "m.safetensors"
    jq.save_safetensors(path, _tree(), metadata={"author": "me"})
    _resave(path, change)
    with pytest.raises(ValueError, match=r"corrupted jaxquant metadata: its CRC-32 is \d+, the "
                                         r"file records '\d+' \(it covers the header and the "
                                         r"metadata entries saved with it, one of which "
                                         r"changed or was removed; the file's other entries"):
        jq.load_safetensors(path)


def test_header_whose_leaves_and_tensors_disagree_names_the_tensor(tmp_path):
    """A re-checksummed header whose leaf says "no zero point" while its tensor is stored."""
    path = tmp_path / "m.safetensors"
    jq.save_safetensors(path, {"layer": _tree()})
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = header["__metadata__"]
    body = json.loads(meta["jaxquant"])
    body["leaves"]["layer/w"]["zero_point"] = False
    meta["jaxquant"] = json.dumps(body)
    rest = {k: v for k, v in meta.items() if k != "jaxquant.crc32"}
    meta["jaxquant.crc32"] = str(zlib.crc32(json.dumps(rest, sort_keys=True,
                                                       separators=(",", ":")).encode()))
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(ValueError, match=r"its leaves and tensors do not match \(tensors no leaf "
                                         r"uses: \['layer/w/zero_point'\]"):
        jq.load_safetensors(path)
