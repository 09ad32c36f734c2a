"""Text generation with MambaLM: `generate` (all new tokens at once), `stream_generate` (one token per
sequence at a time) and `CUDAGraphStep` (a whole decode step, embedding to logits, captured once in a
CUDA graph and replayed).

    out = generate(model, input_ids, max_new_tokens=50)                          # greedy
    out = generate(model, input_ids, 50, do_sample=True, temperature=0.8, top_k=50, top_p=0.95,
                   generator=torch.Generator(device).manual_seed(0))
    for tok in stream_generate(model, input_ids, 50): ...                        # tok: (batch,)

The prompt runs through the blocks' sequence path (MambaLM.prefill, impl=), each new token through the
decode step (MambaLM.step); on CUDA the step is replayed from a CUDA graph unless cuda_graph=False.
Prompts of different lengths (a list of lists) are prefilled as packed sequences in one call where the
path takes them (impl 'unfused'; the reference on the CPU), else one at a time, each into its own row of
the decode cache, and then decoded together: each sequence's tokens are those of generating it alone
(no padding, which a Mamba's state would absorb); generate returns a list of 1-D tensors for them.
Sampling follows transformers: logits / temperature, then top-k (tokens below the k-th largest logit
removed), then top-p (the smallest set of most likely tokens whose probability reaches top_p kept, at
least one), then softmax and torch.multinomial; greedy takes the argmax (the first on ties).
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Sequence

import torch

from .api import is_int
from .model import MambaCache

__all__ = ["generate", "stream_generate", "CUDAGraphStep", "sample_next", "warp_logits", "prompt_batch"]


class CUDAGraphStep:
    """MambaLM.step(input_ids, cache) captured in a CUDA graph on static buffers:

        stepper = CUDAGraphStep(model, cache)
        logits = stepper(next_ids)      # (batch, padded vocab): the static output buffer

    The graph reads the static input buffer, the model's weights and the cache's state tensors, and
    writes the states in place and the static logits, so each call advances the cache by one token
    exactly as model.step would. The returned logits tensor is overwritten by the next call (clone it to
    keep it). The cache's contents are kept across construction (the warm-up steps run on a side stream,
    as torch's CUDA-graph notes ask, on a saved copy that is written back); the graph is bound to these
    cache tensors and this batch size, and must be rebuilt if the model's parameters are replaced
    (in-place changes to their values are seen).
    """

    def __init__(self, model, cache, warmup_steps: int = 2):
        if cache.device is None or cache.device.type != "cuda":
            raise ValueError(f"selscan_fused: CUDAGraphStep needs a cache on a CUDA device, got {cache.device}")
        self.model, self.cache = model, cache
        dev = cache.device
        self.input_ids = torch.zeros(cache.batch_size, dtype=torch.long, device=dev)
        saved = [t.clone() for t in cache.tensors()]
        with torch.no_grad(), torch.cuda.device(dev):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(max(1, warmup_steps)):
                    model.step(self.input_ids, cache)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = model.step(self.input_ids, cache)
            for t, s in zip(cache.tensors(), saved):
                t.copy_(s)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.input_ids.copy_(input_ids)
        self.graph.replay()
        return self.logits


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def prompt_batch(input_ids, device, ragged: bool = False):
    """The prompts as a (batch, L) LongTensor on `device`; a clear error for empty prompts, and for
    prompts of unequal lengths unless `ragged`, which returns those as a list of 1-D LongTensors."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"selscan_fused: input_ids must be a (batch, L) tensor of token ids, got shape "
                             f"{tuple(input_ids.shape)}" + (" (use input_ids[None] for one prompt)"
                                                            if input_ids.dim() == 1 else ""))
        ids = input_ids
    elif (isinstance(input_ids, Sequence) and not isinstance(input_ids, str) and input_ids
          and all(_is_prompt(p) for p in input_ids)):
        lengths = [len(p) for p in input_ids]
        if len(set(lengths)) != 1:
            if not ragged:
                raise ValueError(f"selscan_fused: the prompts have unequal lengths {lengths}; a (batch, L) tensor "
                                 "needs prompts of equal length. Padding is not supported (a Mamba's state would "
                                 "absorb the pad tokens): pass the prompts as a list of lists to generate / "
                                 "stream_generate, which prefill them one at a time")
            if min(lengths) == 0:
                raise ValueError(f"selscan_fused: generate needs prompts of at least one token, got lengths {lengths}")
            out = []
            for p in input_ids:
                t = p if isinstance(p, torch.Tensor) else torch.as_tensor(_token_ids(p))
                if t.dtype not in _INT_DTYPES:
                    raise TypeError(f"selscan_fused: input_ids must hold integer token ids, got {t.dtype}")
                out.append(t.to(device=device, dtype=torch.long))
            return out
        ids = torch.as_tensor([_token_ids(p) for p in input_ids], dtype=torch.long)
    else:
        raise TypeError("selscan_fused: input_ids must be a (batch, L) LongTensor or a list of prompts (each a list "
                        f"of token ids or a 1-D tensor), got {type(input_ids).__name__}")
    if ids.dtype not in _INT_DTYPES:
        raise TypeError(f"selscan_fused: input_ids must hold integer token ids, got {ids.dtype}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"selscan_fused: generate needs at least one prompt of at least one token, got shape "
                         f"{tuple(ids.shape)}")
    return ids.to(device=device, dtype=torch.long)


def _is_prompt(p) -> bool:
    """One prompt: a sequence of token ids (not a string) or a 1-D tensor."""
    if isinstance(p, torch.Tensor):
        return p.dim() == 1
    return isinstance(p, Sequence) and not isinstance(p, str)


def _token_ids(p) -> list:
    """A prompt's token ids as ints; anything but an integer (a float, a bool, a string) is an error, never
    truncated."""
    if isinstance(p, torch.Tensor):
        if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
            raise TypeError(f"selscan_fused: input_ids must hold integer token ids, got {p.dtype}")
        return p.tolist()
    for t in p:
        if not is_int(t):
            raise TypeError(f"selscan_fused: input_ids must hold integer token ids, got {t!r} ({type(t).__name__})")
    return [int(t) for t in p]


def _check_sampling(do_sample, temperature, top_k, top_p):
    if not isinstance(do_sample, bool):
        raise TypeError(f"selscan_fused: do_sample must be True or False, got {do_sample!r}")
    if not do_sample:
        return
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature > 0:
        raise ValueError(f"selscan_fused: temperature must be > 0 for sampling (a number), got {temperature!r} "
                         "(do_sample=False decodes greedily)")
    if not is_int(top_k) or top_k < 0:
        raise ValueError(f"selscan_fused: top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"selscan_fused: top_p must be in (0, 1] (a number; 1 = off), got {top_p!r}")


def _eos_ids(eos_token_id, rows: int) -> list:
    """eos_token_id (an int, a 0-d or 1-D integer tensor, or a sequence of ints) as a list of ints, each in the
    vocabulary [0, rows)."""
    if isinstance(eos_token_id, torch.Tensor):
        if eos_token_id.dim() > 1 or eos_token_id.is_floating_point() or eos_token_id.dtype == torch.bool:
            raise TypeError(f"selscan_fused: eos_token_id must be an integer tensor of at most one dimension, got "
                            f"{eos_token_id.dtype} {tuple(eos_token_id.shape)}")
        ids = eos_token_id.reshape(-1).tolist()
    elif is_int(eos_token_id):
        ids = [int(eos_token_id)]
    elif isinstance(eos_token_id, Iterable) and not isinstance(eos_token_id, str):
        ids = list(eos_token_id)
        if not all(is_int(t) for t in ids):
            raise TypeError(f"selscan_fused: eos_token_id must hold integer token ids, got {eos_token_id!r}")
        ids = [int(t) for t in ids]
    else:
        raise TypeError(f"selscan_fused: eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
    bad = [t for t in ids if not 0 <= t < rows]
    if bad:
        raise ValueError(f"selscan_fused: eos_token_id {bad[0]} is not in the vocabulary [0, {rows})")
    return ids


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling scores (float32, batch x vocab) as transformers' warpers make them: logits / temperature,
    then top-k (scores below the k-th largest set to -inf), then top-p (sorted ascending, the tokens whose
    cumulative probability is <= 1 - top_p set to -inf, the most likely one always kept)."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False  # keep at least one
        scores = scores.masked_fill(remove.scatter(-1, sorted_idx, remove), float("-inf"))
    return scores


def sample_next(logits: torch.Tensor, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token (batch,) from logits (batch, vocab), as transformers' generate picks it: the argmax
    (greedy), or a draw (torch.multinomial, from `generator`) from softmax(warp_logits(...))."""
    if not do_sample:
        return logits.float().argmax(dim=-1)
    probs = warp_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def stream_generate(model, input_ids, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, eos_token_id=None, pad_token_id: int | None = None,
                    cuda_graph: bool = True, generator: torch.Generator | None = None,
                    impl: str | None = None) -> Iterator[torch.Tensor]:
    """An iterator over the new tokens, each (batch,) as it is made; arguments as generate's (checked
    here, before the first token)."""
    _check_sampling(do_sample, temperature, top_k, top_p)
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"selscan_fused: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    device = model.backbone.embedding.weight.device
    ids = prompt_batch(input_ids, device, ragged=True)
    rows = model.backbone.embedding.num_embeddings
    flat = torch.cat(ids) if isinstance(ids, list) else ids
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= rows:
        raise ValueError(f"selscan_fused: the prompts hold token ids outside the vocabulary [0, {rows}): "
                         f"{lo if lo < 0 else hi}")
    eos, fill = None, None
    if eos_token_id is not None:
        eos_list = _eos_ids(eos_token_id, rows)
        if eos_list:
            eos = torch.tensor(eos_list, dtype=torch.long, device=device)
            if pad_token_id is not None and not is_int(pad_token_id):
                raise TypeError(f"selscan_fused: pad_token_id must be an int, got {pad_token_id!r}")
            fill = eos_list[0] if pad_token_id is None else int(pad_token_id)
            if not 0 <= fill < rows:  # finished sequences are fed this token
                what = "pad_token_id" if pad_token_id is not None else "the first eos_token_id"
                raise ValueError(f"selscan_fused: the token finished sequences emit ({what} = {fill}) is not in the "
                                 f"vocabulary [0, {rows})")
    return _stream(model, ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos, fill, cuda_graph, generator,
                   impl)


@torch.no_grad()
def _stream(model, ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos, fill, cuda_graph, generator, impl):
    if max_new_tokens == 0:
        return
    ragged = isinstance(ids, list)  # prompts of different lengths: each prefilled alone into its cache row
    device = ids[0].device if ragged else ids.device
    batch = len(ids)
    cache = model.allocate_cache(batch)
    logits = _prefill_rows(model, ids, cache, impl) if ragged else model.prefill(ids, cache, impl=impl)
    if cuda_graph and device.type == "cuda":
        stepper = CUDAGraphStep(model, cache)
    else:
        stepper = lambda t: model.step(t, cache)  # noqa: E731
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        tok = sample_next(logits, do_sample, temperature, top_k, top_p, generator)
        if eos is not None:
            tok = torch.where(finished, torch.full_like(tok, fill), tok)
            finished |= torch.isin(tok, eos)
        yield tok
        if i + 1 == max_new_tokens or (eos is not None and bool(finished.all())):
            return
        logits = stepper(tok)


def _prefill_rows(model, prompts: list, cache, impl):
    """Each prompt (1-D) through the blocks' sequence path as if alone, its final states written into its
    row of the cache; returns the last position's logits of every prompt (batch, padded vocab). Where
    the path takes packed sequences natively (impl 'unfused', or the reference on the CPU), the prompts
    go through in one packed call (cu_seqlens); elsewhere one call per prompt."""
    path = impl or model.impl
    device = prompts[0].device
    if path == "unfused" or (device.type == "cpu" and path in ("auto", "reference")):
        lengths = torch.tensor([len(p) for p in prompts])
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device=device, dtype=torch.int32)
        logits, states = model(torch.cat(prompts)[None], states=cache.states(), return_states=True, impl=impl,
                               cu_seqlens=cu, validate=False, logits_rows=cu[1:].long() - 1)
        cache.copy_(states)
        return logits[0]
    rows = [MambaCache([t[s:s + 1] for t in cache.ssm_states], [t[s:s + 1] for t in cache.conv_states])
            for s in range(len(prompts))]  # views of the cache's rows: prefill writes through them
    return torch.cat([model.prefill(p[None], row, impl=impl) for p, row in zip(prompts, rows)])


def generate(model, input_ids, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, eos_token_id=None, pad_token_id: int | None = None,
             cuda_graph: bool = True, generator: torch.Generator | None = None,
             impl: str | None = None):
    """Generates up to max_new_tokens tokens after each prompt: returns (batch, L + new) token ids, or
    for prompts of different lengths a list of 1-D tensors (each prompt followed by its new tokens).

    input_ids: (batch, L) LongTensor, or a list of lists of token ids: of equal lengths (a batch), or of
        different lengths, prefilled one at a time into their rows of the decode cache and then decoded
        together (no padding: a Mamba's state would absorb pad tokens); each sequence's tokens are those
        of generating it alone.
    do_sample=False: greedy. do_sample=True: temperature (> 0), top_k (0 = off), top_p (1 = off) as
        transformers defines them; generator: the torch.Generator multinomial draws from (on the model's
        device), for reproducible samples.
    eos_token_id (int or list): a sequence that emits it is finished and emits pad_token_id (default: the
        first eos id) afterwards; generation stops when every sequence has finished, so fewer than
        max_new_tokens columns may come back.
    cuda_graph: replay the decode step from a CUDA graph (CUDA only; ignored on the CPU).
    impl: the blocks' path for the prompt (default the model's).
    """
    device = model.backbone.embedding.weight.device
    ids = prompt_batch(input_ids, device, ragged=True)
    new = list(stream_generate(model, ids, max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                               top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                               cuda_graph=cuda_graph, generator=generator, impl=impl))
    if isinstance(ids, list):
        cols = torch.stack(new, dim=1) if new else torch.zeros(len(ids), 0, dtype=torch.long, device=device)
        return [torch.cat([p, cols[s]]) for s, p in enumerate(ids)]
    if not new:
        return ids
    return torch.cat([ids, torch.stack(new, dim=1)], dim=1)
