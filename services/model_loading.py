"""How a command gets its model: the directory (pulled on first use, with its progress on stderr),
the check that JAX is installed, the JAX model as the engine process builds it (and a draft
model's proposer, `--draft-model`), and the scripted stand-in. Shared by the serving commands (services.cli) and `generate/chat --local`
(services.generation_commands).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

from services.config import ModelOptions, ProcessGroup


def say(line: str) -> None:
    """A line for the person running the command, on stderr at once."""
    print(line, file=sys.stderr, flush=True)


def find_model_dir(name_or_dir: str, cache: Path | None) -> Path:
    """The model's directory, pulled first when a registered model is not prepared yet (its steps
    and download progress on stderr)."""
    from engine.model_store.registry import resolve_model
    from services.download_progress import DownloadProgress

    return resolve_model(name_or_dir, cache, log=say, progress=DownloadProgress())


def require_jax(what: str) -> None:
    """JAX comes with the `cpu`, `cuda12` or `cuda13` extra (or a GPU image's own); the text-side
    install (`tokenwire[text]`) has none.
    Looked up, not imported: the decode server's own process never needs it (its engine process does)."""
    import importlib.util

    if importlib.util.find_spec("jax") is None:
        raise RuntimeError(
            f"{what} runs the model with JAX, which this installation lacks: "
            "pip install 'tokenwire[cpu]' (or 'tokenwire[cuda12]' / 'tokenwire[cuda13]' for an NVIDIA GPU)"
        )


def load_model(model_dir, max_batch_size: int, options: ModelOptions, group: ProcessGroup | None = None):
    """The model, split over `options.tensor_parallel` devices; in a process group, process 0's
    wrapped to publish its steps and the others' to follow them (engine.jax_backend.multihost)."""
    from engine.jax_backend.jax_model import JaxModel

    if options.compilation_cache:  # before anything compiles
        from engine.jax_backend import compilation_cache
        from engine.model_store.registry import default_cache_dir

        compilation_cache.enable((options.cache_dir or default_cache_dir()) / "xla")
    if group is not None:
        from engine.jax_backend import multihost

        joined = multihost.Group(group.coordinator, group.num_processes, group.process_id, group.timeout_s)
        multihost.initialize(joined, options.tensor_parallel // group.num_processes)
    model = JaxModel.load(model_dir, options, max_batch_size=max_batch_size)
    if group is None:
        return model
    return multihost.Leader(model) if joined.leads else multihost.Follower(model, joined)


def check_draft(model_dir: Path, draft_dir: Path, max_context_length: int | None) -> None:
    """Refuse (ValueError, one line) a draft model that cannot guess for the model, from their
    files, before either loads: a draft's guesses are ids of its tokenizer, so the two tokenizers
    must have as many ids (1 + the largest id of tokenizer.json, as the model's head has columns)
    and the same EOS ids (config.json, generation_config.json and the tokenizer's EOS token); and
    the draft must hold the model's whole context (`max_context_length`, else as the model's load
    decides it: min(max_position_embeddings, 2048)). Tokenizers of one size whose ids mean
    different tokens pass: their guesses are rejected, which costs time and never changes output."""
    from engine.model_store.checkpoint import parse_config, tokenizer_size
    from engine.model_store.model_files import eos_token_ids

    model, draft = (parse_config(json.loads((d / "config.json").read_text())) for d in (model_dir, draft_dir))
    ids = tokenizer_size(model_dir, model.vocab_size), tokenizer_size(draft_dir, draft.vocab_size)
    if ids[0] != ids[1]:
        raise ValueError(f"--draft-model {draft_dir}: its tokenizer has {ids[1]} ids and the model's {ids[0]}: "
                         "a draft model must have the model's tokenizer")
    eos = eos_token_ids(model_dir), eos_token_ids(draft_dir)
    if eos[0] != eos[1]:
        raise ValueError(f"--draft-model {draft_dir}: its EOS ids {sorted(eos[1])} differ from the model's "
                         f"{sorted(eos[0])}: a draft model must have the model's tokenizer")
    context = max_context_length or min(model.max_position_embeddings, 2048)
    if draft.max_position_embeddings < context:
        raise ValueError(f"--draft-model {draft_dir}: its context of {draft.max_position_embeddings} positions "
                         f"(max_position_embeddings) is shorter than the model's {context}")


def draft_proposer(draft_dir: Path, max_batch_size: int, options: ModelOptions, model):
    """The draft model's proposer (engine.core.speculation.draft), built in the engine process
    once `model` is loaded: the draft loaded and warmed up with the model's options and slots, in
    the model's context, with no verify step of its own. A KV cache sized as a share of the
    accelerator's memory is the model's: the draft's pool holds a whole context per slot.
    Raises as engine.core.model.load does (a refusal: exit 2)."""
    import functools

    from engine.core.model import load
    from engine.core.speculation.draft import DraftProposer
    from engine.jax_backend.jax_model import JaxModel

    o = dataclasses.replace(options, max_context_length=model.info.max_context_length, max_guesses=0)
    if o.kv_cache_memory_fraction is not None:
        o = dataclasses.replace(o, kv_cache_memory_fraction=None, kv_cache_tokens=0)
    logging.getLogger("tokenwire").info("draft model %s: loading with the model's options; its own memory plan follows", draft_dir)
    draft = load(functools.partial(JaxModel.load, draft_dir, o, max_batch_size=max_batch_size, model_id=f"draft:{draft_dir.name}"))
    return DraftProposer(draft)


SCRIPTED_PREFIX = "scripted:"


def scripted_model(
    model_dir: Path, *, max_batch_size: int, max_context_length: int | None, step_ms: float, kv_cache_tokens: int = 0,
    max_guesses: int = 0,
):
    """The scripted model (engine.core.scripted_model: the token after t is t + 1) with a fixed
    step time, in place of a real one: a stand-in for an accelerator when measuring the transport
    (`decode-server --model scripted:DIR`, and benchmarks/transport.py in process). Its vocabulary
    size and EOS ids are those of `model_dir`'s tokenizer, so a text service for that model can sit
    in front of it."""
    from engine.core.scripted_model import ScriptedModel
    from engine.model_store.checkpoint import tokenizer_size
    from engine.model_store.model_files import eos_token_ids

    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"--model scripted:DIR takes its vocabulary from DIR/tokenizer.json, and {model_dir} has none")
    return ScriptedModel(
        kv_cache_tokens=kv_cache_tokens,
        vocab_size=tokenizer_size(model_dir, 1 << 31),
        eos_token_ids=eos_token_ids(model_dir),
        max_batch_size=max_batch_size,
        max_context_length=max_context_length or 2048,
        step_delay_s=step_ms / 1000,
        model_id=f"{SCRIPTED_PREFIX}{model_dir.name}",
        max_guesses=max_guesses,
    )
