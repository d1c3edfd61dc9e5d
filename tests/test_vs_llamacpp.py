"""benchmarks/vs_llamacpp.py's round order: each of our servers is measured right before the
llama.cpp file it is compared with, and every configuration exactly once a round (the run
itself needs a llama.cpp build and is never part of CI)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.vs_llamacpp import Server, round_order


def test_a_round_pairs_each_server_with_its_file_and_measures_everything_once():
    servers = [Server(w, t, "model", 32) for t in (2, 1) for w in ("float32", "int8")]
    ggufs = {"F32": Path("f32.gguf"), "Q8_0": Path("q8_0.gguf"), "Q4_1": Path("model.gguf")}
    order = round_order(servers, ggufs, [2, 1])
    labels = [label for label, _ in order]
    assert len(labels) == len(set(labels)) == len(servers) + len(ggufs) * 2
    for s in servers:
        at = labels.index(s.label)
        label, (path, threads) = order[at + 1]
        assert (label, path, threads) == (f"llama.cpp {'F32' if s.weights == 'float32' else 'Q8_0'}, {s.label.split(', ')[1]}",
                                          ggufs["F32" if s.weights == "float32" else "Q8_0"], s.threads)
    assert {target for _, target in order if not isinstance(target, Server)} == {(p, t) for p in ggufs.values() for t in (2, 1)}
