"""engine.model_store.gguf_reader: gguf-py's parse over a plain view of the memory map gives what
gguf-py's own reader gives, field for field and tensor for tensor, with plain views.

Real parts: a GGUF written by gguf-py's own writer (strings, arrays of strings and numbers,
scalars of several types; float32, float16 and Q8_0 tensors), read by gguf.GGUFReader as the
reference."""

from __future__ import annotations

import gc

import gguf
import numpy as np
import pytest

from engine.model_store.gguf_reader import GGUFFile, open_gguf


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "small.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_token_list([f"piece{i}" for i in range(300)] + ["é", "<|im_end|>"])
    w.add_token_types([1] * 301 + [3])
    w.add_token_scores([float(i) / 7 for i in range(302)])
    w.add_array("tokenizer.ggml.merges", ["p i", "pi e", "pie ce"])
    w.add_tensor("token_embd.weight", rng.normal(size=(302, 64)).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", rng.normal(size=64).astype(np.float16))
    q8 = gguf.quants.quantize(rng.normal(size=(32, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_the_fields_and_tensors_are_gguf_pys_own(path):
    ours, theirs = open_gguf(path), gguf.GGUFReader(path, "r")
    assert isinstance(ours, GGUFFile) and list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.types, mine.contents()) == (field.types, field.contents()), key
    assert ours.get_field("tokenizer.ggml.tokens").contents()[-2:] == ["é", "<|im_end|>"]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] == [
        "token_embd.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight"]
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert (mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == (t.tensor_type, t.n_elements, t.n_bytes, t.data_offset)
        np.testing.assert_array_equal(mine.shape, t.shape)
        assert (mine.data.dtype, mine.data.shape) == (t.data.dtype, t.data.shape)
        np.testing.assert_array_equal(mine.data, t.data)
    q8 = ours.tensors[2]
    assert q8.tensor_type == gguf.GGMLQuantizationType.Q8_0
    np.testing.assert_array_equal(gguf.quants.dequantize(q8.data, q8.tensor_type), gguf.quants.dequantize(theirs.tensors[2].data, q8.tensor_type))


def test_its_views_are_plain_read_only_and_keep_the_file_mapped(path):
    """Plain ndarrays (what makes the parse cheap: no memmap subclass per view) over the file's
    mapping, not copies of it, read-only, and readable after the reader itself is gone."""
    ours = open_gguf(path)
    tensor, tokens = ours.tensors[0], ours.get_field("tokenizer.ggml.tokens")
    assert type(ours.data) is np.ndarray and type(tensor.data) is np.ndarray
    assert not any(isinstance(part, np.memmap) for part in tokens.parts)
    assert np.shares_memory(tensor.data, ours._mapped) and not tensor.data.flags.writeable
    expected = np.array(tensor.data)
    data = tensor.data
    del ours, tensor, tokens
    gc.collect()
    np.testing.assert_array_equal(data, expected)
