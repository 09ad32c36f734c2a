"""Command line generation with a MambaLM checkpoint directory (either layout):

    python -m selscan_fused.generate --model DIR --prompt "text" --max-new-tokens 50
    python -m selscan_fused.generate --model DIR --ids 1,2,3 --max-new-tokens 20 --temperature 0.8 --top-p 0.9

--prompt needs DIR/tokenizer.json and the `tokenizers` package; without them give the prompt's token ids
with --ids and the new ids are printed. Greedy unless --temperature > 0 (then sampled, with --top-k /
--top-p as transformers defines them; --seed makes it reproducible). New tokens stream to stdout as they
are made; the layout found and the settings go to stderr.

(The library functions are in selscan_fused.generation; `selscan_fused.generate` is also the function.)
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import torch

from .generation import generate, stream_generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _load_tokenizer(model_dir: str):
    """(tokenizer or None, why not)."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None, f"{model_dir} has no tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None, "the `tokenizers` package is not installed (pip install tokenizers)"
    return Tokenizer.from_file(path), None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m selscan_fused.generate",
                                description="Generate text (or token ids) with a Mamba checkpoint directory "
                                            "(mamba-ssm's or Hugging Face's layout).")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + weights)")
    p.add_argument("--prompt", help="prompt text (needs DIR/tokenizer.json and the tokenizers package)")
    p.add_argument("--ids", help="prompt token ids, comma separated (instead of --prompt)")
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus probability (1: off)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling generator")
    p.add_argument("--eos", type=int, default=None, help="end-of-sequence id (default: the config's, if any)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at an end-of-sequence token")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--impl", default="auto", choices=["auto", "unfused", "fused", "reference"],
                   help="the blocks' path for the prompt (default auto)")
    p.add_argument("--decode-impl", default="auto", choices=["auto", "kernel", "torch"],
                   help="the decode step's path (default auto; kernel: the decode kernels, CUDA)")
    p.add_argument("--no-cuda-graph", action="store_true", help="do not replay the decode step from a CUDA graph")
    p.add_argument("--print-ids", action="store_true", help="print token ids even when a tokenizer is available")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from .model import MambaLM

    err = sys.stderr
    if (args.prompt is None) == (args.ids is None):
        print("error: give exactly one of --prompt TEXT or --ids 1,2,3", file=err)
        return 2
    if not os.path.isdir(args.model):
        print(f"error: --model {args.model!r} is not a directory (a checkpoint directory: config.json and the "
              "weights)", file=err)
        return 2
    if args.max_new_tokens < 0:
        print(f"error: --max-new-tokens must be >= 0, got {args.max_new_tokens}", file=err)
        return 2
    if args.temperature < 0:
        print(f"error: --temperature must be >= 0 (0: greedy), got {args.temperature}", file=err)
        return 2
    if args.top_k < 0 or not 0 < args.top_p <= 1:
        print(f"error: --top-k must be >= 0 and --top-p in (0, 1], got {args.top_k} and {args.top_p}", file=err)
        return 2
    tokenizer, why = _load_tokenizer(args.model)
    if args.ids is not None:
        try:
            prompt_ids = [int(t) for t in args.ids.replace(" ", "").split(",") if t != ""]
        except ValueError:
            print(f"error: --ids must be comma-separated integers, got {args.ids!r}", file=err)
            return 2
        if not prompt_ids:
            print("error: --ids is empty", file=err)
            return 2
    else:
        if tokenizer is None:
            print(f"error: --prompt needs a tokenizer, but {why}; give the prompt's token ids with --ids", file=err)
            return 2
        prompt_ids = tokenizer.encode(args.prompt).ids
        if not prompt_ids:
            print("error: the prompt encodes to no tokens", file=err)
            return 2
    if args.temperature <= 0 and (args.top_k or args.top_p < 1.0):
        print("error: --top-k / --top-p apply to sampling; set --temperature > 0", file=err)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        model = MambaLM.from_pretrained(args.model, device=device, dtype=dtype, impl=args.impl).eval()
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        print(f"error: could not load {args.model}: {e}", file=err)
        return 1
    model.decode_impl = args.decode_impl
    if args.decode_impl == "kernel":
        from .decode import decode_kernel_reason
        m = model.backbone.layers[0].mixer
        reason = decode_kernel_reason(torch.empty(1, model.config.d_model, device=device, dtype=dtype), m.d_state,
                                      m.dt_rank, m.d_conv)
        if reason is not None:
            print(f"error: --decode-impl kernel cannot run here: {reason}; use --decode-impl torch (impl='torch')",
                  file=err)
            return 2
    info = model.checkpoint_info
    c = model.config
    print(f"selscan_fused: {info['path']}: {info['layout_name']} ({', '.join(info['files'])}); {c.n_layer} layers, "
          f"d_model {c.d_model}, vocabulary {c.padded_vocab_size}; {dtype} on {device}, impl {args.impl}, "
          f"decode {args.decode_impl}", file=err)
    eos = None if args.ignore_eos else (args.eos if args.eos is not None else c.eos_token_id)
    generator = None
    if args.temperature > 0 and args.seed is not None:
        generator = torch.Generator(device=device).manual_seed(args.seed)
    try:  # the arguments are checked here, before anything is printed
        tokens = stream_generate(model, torch.tensor([prompt_ids]), args.max_new_tokens,
                                 do_sample=args.temperature > 0, temperature=args.temperature or 1.0,
                                 top_k=args.top_k, top_p=args.top_p, eos_token_id=eos,
                                 cuda_graph=not args.no_cuda_graph, generator=generator)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=err)
        return 2
    as_text = tokenizer is not None and not args.print_ids
    out = sys.stdout
    # Text: the whole sequence is decoded each time and what is new printed (tokens can end inside a
    # character, and a continuation decoded alone loses the spaces between it and the prompt).
    shown = tokenizer.decode(prompt_ids) if as_text else " ".join(map(str, prompt_ids))
    out.write(shown)
    out.flush()
    seq = list(prompt_ids)
    for tok in tokens:
        t = int(tok[0])
        seq.append(t)
        if as_text:
            text = tokenizer.decode(seq)
            if text.endswith("\ufffd"):
                continue
            out.write(text[len(shown):] if text.startswith(shown) else tokenizer.decode([t]))
            shown = text
        else:
            out.write(f" {t}")
        out.flush()
    if as_text and tokenizer.decode(seq) != shown:  # an incomplete character at the end
        out.write(tokenizer.decode(seq)[len(shown):])
    out.write("\n")
    out.flush()
    return 0


class _CallableModule(types.ModuleType):
    """`import selscan_fused.generate` rebinds the package's attribute `generate` (the function) to this
    module; calling the module calls the function, so `selscan_fused.generate(model, ...)` keeps working."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
