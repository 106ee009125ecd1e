"""Generate with a Hugging Face model whose KV cache lives in pagekv pages.

    pip install torch==2.13.0 "pagekv[transformers]"      # torch first: pick its CPU build
    python examples/transformers_generate.py               # a tiny random Llama, no download
    python examples/transformers_generate.py --model Qwen/Qwen2.5-0.5B-Instruct   # a real one

Two calls share a system prompt: the second reuses the first one's pages (the prefix cache), which
the pool's stats show. With ``--compare`` the same prompts also go through transformers' default
cache and attention, and the script checks that the generated tokens agree.
"""

import argparse
import time

import torch
import transformers

from pagekv.integrations.transformers import PagedKVPool

SYSTEM = "You are a careful assistant. Answer in one short sentence. "
QUESTIONS = [["What is a page table?", "Why do caches use pages?"],
             ["What is copy-on-write?", "What does a prefix cache store?", "Why page KV caches?"]]


def load(name):
    """(model, tokenizer or None): a hub model, or a tiny random Llama built from a config."""
    if name != "tiny":
        tokenizer = transformers.AutoTokenizer.from_pretrained(name, padding_side="left")
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
        return model.eval(), tokenizer
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(config).eval(), None


def encode(tokenizer, texts):
    """Left-padded ids and mask; without a tokenizer, bytes of the text are the token ids."""
    if tokenizer is not None:
        return tokenizer(texts, return_tensors="pt", padding=True)
    rows = [list((SYSTEM + text).encode())[:255] for text in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def decode(tokenizer, ids):
    """Text of each row; the tiny random model's output is noise, so its token ids are shown."""
    if tokenizer is not None:
        return tokenizer.batch_decode(ids, skip_special_tokens=True)
    return [f"token ids {row.tolist()[:12]}..." for row in ids]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a hub model id, or 'tiny' (default: random)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--num-pages", type=int, default=512, help="pages in the pool (default 512)")
    parser.add_argument("--compare", action="store_true",
                        help="also run transformers' default cache and attention, and compare tokens")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=False,
                   pad_token_id=tokenizer.pad_token_id if tokenizer else 0)
    batches = [encode(tokenizer, [SYSTEM + q for q in questions] if tokenizer else questions)
               for questions in QUESTIONS]
    expected = [model.generate(**batch, **options) for batch in batches] if args.compare else None

    pool = PagedKVPool(model, num_pages=args.num_pages, page_size=16)
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        out = pool.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **options)
        seconds = time.perf_counter() - start
        stats = pool.stats()
        print(f"call {i + 1}: {out.shape[0]} prompts in {seconds:.2f} s; prefix-cache hits so far: "
              f"{stats.prefix_hit_tokens} tokens; pages cached: {stats.pages_cached}")
        new_tokens = out[:, batch["input_ids"].shape[1]:]
        for text in decode(tokenizer, new_tokens):
            print("   ", text)
        if expected is not None:
            same = torch.equal(out, expected[i])
            print(f"    same tokens as transformers' default path: {same}")
            if not same:
                raise SystemExit(1)
    pool.close()


if __name__ == "__main__":
    main()
