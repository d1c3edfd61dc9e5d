"""Speculative decoding (issue 45): guessed ids, checked by the model in one pass.

At small batches a decode step is bound by reading the weights, and feeding a slot its last
sample plus k guessed ids costs about that same read. `Model.verify` samples at every fed
position as plain decoding would and returns the run up to the first guess it rejects, so each
accepted guess is a token for one pass's price, and the output is plain decoding's (greedy: the
same ids; sampled: the same distribution, by rejection sampling).

The parts, one noun per file:
  * `proposer`: the `Proposer` interface (guesses for the rows of a step, from each request's
    ids so far) and `proposer_named`, the registry the `--speculation` flag picks from;
  * `ngram`: the model-free proposer: the latest earlier occurrence of the sequence's last n
    ids (n from 4 down to 1), over the request's own prompt and output; what followed it is the
    guess, and that source is followed while the output keeps copying it. Text that copies its
    input (code edits, extraction, quoting) gets long runs;
  * `draft`: a draft model's proposer (`--draft-model`): a small model with the same tokenizer,
    a slot of its own per request, k batched greedy decode steps for every row of a step;
  * `policy`: when a row speculates and how many ids it guesses: per-row acceptance with a
    rest when it is low, as many guesses as its recent runs earn, fewer as the batch
    grows, none above a batch size;
  * engine.core.speculative_step: the scheduler's verify step (pages for the guesses, each
    run's samples through `stopping.decide` one by one, one message per run).
"""
