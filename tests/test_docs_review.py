"""Statements of the README, the mkdocs pages and the public docstrings, held to the code.

Each test runs the behaviour a sentence describes and checks that the sentence says it:
the layers `jaxquant.flax` covers, what `jax.grad` does with a tree of `QTensor` leaves,
which names each API page documents, rule containers, abstract trees, 6-bit packing and
the reserved ``__metadata__`` name of safetensors.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = ROOT / "docs"


def _words(text: str) -> str:
    """``text`` with its line breaks and runs of blanks as single spaces."""
    return " ".join(text.split())


def test_index_table_lists_every_api_page_and_its_names():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| \[[^\]]+\]\((api/\w+\.md)\) \| (.*) \|$", index, re.MULTILINE))
    pages = sorted(p.relative_to(DOCS).as_posix() for p in (DOCS / "api").glob("*.md"))
    assert sorted(rows) == pages
    for page in pages:
        targets = re.findall(r"^::: (jaxquant(?:\.\w+)+)$", (DOCS / page).read_text("utf-8"),
                             re.MULTILINE)
        named = set(re.findall(r"`([\w.]+)`", rows[page]))
        for target in targets:
            parent, name = target.rsplit(".", 1)
            # a submodule's members are covered by the submodule's own name in the row
            covered = name in named or target in named or (
                parent != "jaxquant" and parent in named)
            assert covered, f"{page}: {target} is not in the index row"


def test_index_names_float6_codes():
    index = _words((DOCS / "index.md").read_text(encoding="utf-8"))
    assert "float8, float6 or float4 codes" in index
    assert "float6_e2m3fn" in jq.CODEBOOKS


def test_flax_covered_layers_are_the_code_tuples():
    import jaxquant.flax as jf
    from jaxquant.flax import _nnx_graph, linen

    doc = _words(jf.__doc__)
    covered = doc[doc.index("Covered layers:"):]
    linen_part, nnx_part = covered.split("; nnx ")
    names = lambda part: set(re.findall(r"``(\w+)``", part.split(" (")[0]))  # noqa: E731
    assert names(linen_part) == {c.__name__ for c in linen.LAYERS}
    assert names(nnx_part) == {c.__name__ for c in _nnx_graph.LAYERS}
    flax = _words(README[README.index("## Flax"):README.index("- linen:")])
    for cls in linen.LAYERS:  # the README names the linen layer or its nnx counterpart
        assert re.search(rf"\b{cls.__name__}\b", flax), cls.__name__
    assert "ConvLocal (linen)" in flax
    arch = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    row = re.search(r"^\| `flax/_linen_infer\.py` \|.*$", arch, re.MULTILINE).group(0)
    assert "ConvTranspose" in row and "ConvLocal" in row


def test_readme_grad_over_qtensor_trees_as_stated():
    """Integer codes make ``jax.grad`` refuse the tree; float8 codes are differentiated."""
    def loss(tree):
        return jq.dequantize(tree["w"]).sum()

    w = jnp.array([[0.7, -1.3], [2.0, 0.1]])
    with pytest.raises(TypeError, match="int8"):
        jax.grad(loss)({"w": jq.quantize(w)})
    g = jax.grad(loss)({"w": jq.quantize(w, dtype=jnp.float8_e4m3fn)})["w"]
    assert float(jnp.abs(g.scale).sum()) > 0  # a float update, that apply_updates would add
    paragraph = _words(README[README.index("Training on top of quantized weights"):
                              README.index("```python", README.index("Training on top"))])
    assert "refuses a tree holding integer or codebook `QTensor`s" in paragraph
    assert "float8 / float4" in paragraph


def test_quantize_codes_are_constants_of_differentiation_as_documented():
    x = jnp.linspace(-2.0, 3.0, 64).reshape(1, 64)
    cases = [dict(scale=jnp.float32(0.5), dtype=jnp.int8),
             dict(scale=jnp.float32(0.5), dtype=jnp.float8_e4m3fn),
             dict(dtype="nf4"), dict(dtype="mxfp4")]
    for kw in cases:
        g = jax.grad(lambda x, kw=kw: jq.dequantize(jq.quantize(x, **kw)).sum())(x)
        assert not bool(g.any()), kw["dtype"]
    assert "constants of differentiation" in _words(jq.quantize.__doc__)


def test_weak_scales_are_float32_as_documented():
    x = jnp.ones(4)
    assert jq.quantize(x, 0.5).scale.dtype == jnp.float32
    assert jq.quantize(x, jnp.bfloat16(0.5)).scale.dtype == jnp.bfloat16  # kept
    assert jq.QTensor(jnp.ones(4, jnp.int8), jnp.array(0.5)).scale.dtype == jnp.float32
    assert "a weakly typed one" in _words(jq.quantize.__doc__)
    assert "a weakly typed one" in _words(jq.QTensor.__doc__)


def test_trees_page_rule_containers_and_abstract_leaves():
    page = _words((DOCS / "api" / "trees.md").read_text(encoding="utf-8"))
    tree = {"w": jnp.ones((4, 4))}
    spec = jq.QuantSpec()
    assert jq.is_qtensor(jq.quantize_tree(tree, (("w", spec),))["w"])  # a tuple of rules
    with pytest.raises(TypeError, match="set"):
        jq.quantize_tree(tree, {("w", spec)})
    rules = (r for r in [("w", spec)])
    list(rules)
    with pytest.raises(ValueError, match="generator"):
        jq.quantize_tree(tree, rules)
    assert "a set is refused (`TypeError`)" in page and "consumed (`ValueError`" in page
    abstract = jq.quantize_tree({"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)})
    back = jq.dequantize_tree(abstract)["w"]
    assert isinstance(back, jax.ShapeDtypeStruct) and back.shape == (4, 4)
    assert "dequantize to `jax.ShapeDtypeStruct`s" in page


def test_dequantize_tree_of_stacked_qtensors_as_documented():
    """Layers stacked by vmap dequantize layer by layer, each with its own scales."""
    x = jnp.arange(48.0).reshape(3, 4, 4) ** 1.5
    stacked = jax.vmap(lambda a: jq.quantize(a, axis=1))(x)
    got = jq.dequantize_tree({"w": stacked})["w"]
    want = np.stack([np.asarray(jq.dequantize(jq.quantize(a, axis=1))) for a in x])
    np.testing.assert_array_equal(np.asarray(got), want)
    abstract = jq.dequantize_tree(jax.eval_shape(lambda: {"w": stacked}))["w"]
    assert (abstract.shape, abstract.dtype) == ((3, 4, 4), jnp.float32)
    assert "dequantized layer by layer" in _words(inspect.getdoc(jq.dequantize_tree))


def test_packing_page_and_checkpoint_docstring_name_6_bit_packing():
    qt = jq.quantize(jnp.ones((2, 8)), dtype="float6_e2m3fn")
    packed = jq.pack(qt)
    assert packed.qvalue.data.shape == (2, 6)  # four codes in three bytes
    page = _words((DOCS / "api" / "packing.md").read_text(encoding="utf-8"))
    assert "four in three bytes" in page
    assert "6-bit codes four in three bytes" in _words(jq.save_safetensors.__doc__)
    with pytest.raises(TypeError, match="2- and 4-bit"):
        jq.pack_bits(jnp.ones(4, jnp.uint8))
    assert "`pack_bits` / `unpack_bits` take 2- and 4-bit formats only" in page


def test_save_safetensors_metadata_name_as_documented(tmp_path):
    pytest.importorskip("safetensors")
    with pytest.raises(ValueError, match="__metadata__"):
        jq.save_safetensors(tmp_path / "a.safetensors", {"__metadata__": jnp.ones(2)})
    qt = jq.quantize(jnp.ones((2, 2)))
    jq.save_safetensors(tmp_path / "b.safetensors", {"__metadata__": qt})
    back = jq.load_safetensors(tmp_path / "b.safetensors")["__metadata__"]
    assert bool((back.qvalue == qt.qvalue).all())
    doc = _words(jq.save_safetensors.__doc__)
    assert "an array leaf at the path ``\"__metadata__\"``" in doc


def test_linen_conv_transpose_takes_a_non_int8_actspec_at_inference():
    nn = pytest.importorskip("flax.linen")
    from jaxquant.flax import ActSpec, QuantConfig, quantize_linen

    x = jnp.linspace(-1.0, 1.0, 16).reshape(1, 8, 2)
    for layer, runs in [(nn.ConvTranspose(3, (3,)), True), (nn.Conv(3, (3,)), False)]:
        qm = quantize_linen(layer, QuantConfig(act=ActSpec(dtype=jnp.int4)))
        q = qm.quantize_params(qm.init(jax.random.key(0), x), x)
        if runs:
            assert qm.apply(q, x).shape == (1, 8, 3)
        else:
            with pytest.raises(ValueError, match="int8"):
                qm.apply(q, x)
    from jaxquant.flax import QuantizedLinen
    doc = _words(inspect.getdoc(QuantizedLinen.apply))
    assert "on a layer with an int8 x int8 path" in doc
    assert "``input_grams``" in inspect.getdoc(quantize_linen)
