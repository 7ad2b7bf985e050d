"""What every bench shares, so that none imports another bench:

- `args`: the common options (prompts, model, server, --out);
- `data`: the MuSiQue questions and passages;
- `engine`: an engine in this process (prompts with their chunks' KV, a timed prefill, greedy answers,
  decode speed);
- `servers` and `client`: `ragblend serve` started here, and the HTTP calls made to it (ingest, streamed
  answers timed per token);
- `stats` and `fidelity`: medians, percentiles, ratios with their spread, turn order; F1 and KL;
- `output`: the JSON summary (stdout's last line and --out), table cells, one-line errors.
"""
