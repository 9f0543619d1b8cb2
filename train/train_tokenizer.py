#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer on data/train.txt and tokenise the corpus into .bin files.

Tokenizer:
  * HF `tokenizers` BPE, ByteLevel pre-tokenizer (GPT-2 split regex, no prefix space) and
    ByteLevel decoder, so any UTF-8 text round-trips exactly.
  * vocab 8192. Ids 0..106 are special tokens at Gemma 4's fixed ids (pad 0, eos 1, bos 2,
    unk 3, <|tool_call> 48, <tool_call|> 49, <|tool_response> 50, <|"|> 52, <|channel> 100,
    <channel|> 101, <|turn> 105, <turn|> 106); the other ids below 107 are `<unusedN>`
    placeholders (N = the id). The learned vocabulary (256 byte symbols, then merges) starts
    at id 107.
  * A post-processor prepends <bos> when `add_special_tokens` is on (as Gemma does).
  * tokenizer_config.json names bos/eos/pad/unk and carries a minimal Gemma-style chat
    template (`<|turn>{role}\n{content}<turn|>\n`, "assistant" rendered as "model").

Corpus tokenisation (special-token strings inside source code are encoded as plain text):
  every document -> [BOS=2] + ids + [EOS=1], concatenated in file order, stored as a flat
  little-endian uint16 numpy array (raw, no header): data/train.bin and data/heldout.bin.
  data/heldout_index.json lists every held-out document: path, start offset in heldout.bin
  (the position of its BOS) and length in tokens (BOS and EOS included).

  data/unseen.bin and data/unseen_index.json do the same for unseen.txt (the packages kept
  out of training), when prepare_corpus.py wrote one.

Usage:  python train_tokenizer.py [--data DIR] [--out DIR] [--vocab 8192] [--reuse DIR]
  --data   folder with train.txt / heldout.txt (default: data/ next to this script)
  --out    tokenizer output folder (default: DATA/tokenizer)
  --reuse  copy the tokenizer of this model folder (tokenizer.json + tokenizer_config.json)
           instead of training one, so token ids and per-token perplexities stay comparable
           with that model's (the second default model reuses the first one's tokenizer)
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
DOC_SEP = "\x1e\n"
BOS, EOS, PAD = 2, 1, 0

SPECIAL_IDS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    52: '<|"|>',
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}
N_RESERVED = 107

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' + message['content'] + '<turn|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)
CHAT_SAMPLE = "<bos><|turn>user\nRename x to y.<turn|>\n<|turn>model\n"


def read_docs(path):
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    docs = text.split(DOC_SEP)
    assert docs[-1] == "", "file must end with the document separator"
    return docs[:-1]


def build(train_docs, vocab_size):
    specials = [SPECIAL_IDS.get(i, f"<unused{i}>") for i in range(N_RESERVED)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer, length=len(train_docs))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS)]
    )
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    for i, s in enumerate(specials):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s), i)
    return tok


def encode_docs(tok, docs):
    """Documents -> list of id lists; special-token strings in the text stay plain text."""
    tok.encode_special_tokens = True
    try:
        return [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    finally:
        tok.encode_special_tokens = False


def write_bin(path, id_lists):
    n = sum(len(x) + 2 for x in id_lists)
    arr = np.empty(n, dtype=np.uint16)
    pos = 0
    for ids in id_lists:
        arr[pos] = BOS
        arr[pos + 1 : pos + 1 + len(ids)] = ids
        arr[pos + 1 + len(ids)] = EOS
        pos += len(ids) + 2
    assert pos == n
    arr.astype("<u2").tofile(path)
    return n


def check_roundtrip(tok, docs, id_lists):
    for doc, ids in zip(docs, id_lists):
        assert all(i >= N_RESERVED for i in ids), "special id inside a plain document"
        back = tok.decode(ids, skip_special_tokens=False)
        assert back == doc, f"round trip failed for {doc[:60]!r}"


def check_hf(out_dir, sample_docs):
    """Cross-check with transformers' own loading (skipped when transformers is missing)."""
    try:
        from transformers import AutoTokenizer
    except Exception as e:  # pragma: no cover
        return f"skipped ({type(e).__name__})"
    hf = AutoTokenizer.from_pretrained(out_dir)
    for doc in sample_docs:
        ids = hf(doc)["input_ids"]
        assert ids[0] == BOS
        assert hf.decode(ids, skip_special_tokens=True) == doc
    msgs = [{"role": "user", "content": "Rename x to y."}]
    rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == CHAT_SAMPLE, repr(rendered)
    assert hf.eos_token_id == EOS and hf.bos_token_id == BOS and hf.pad_token_id == PAD
    return "ok"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reuse", default=None)
    args = ap.parse_args()
    data = Path(args.data)
    out = Path(args.out) if args.out else data / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)

    train_docs = read_docs(data / "train.txt")
    held_docs = read_docs(data / "heldout.txt")
    print(f"== {len(train_docs)} train docs, {len(held_docs)} held-out docs")

    t0 = time.time()
    if args.reuse:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(args.reuse) / name, out / name)
        print(f"== reusing the tokenizer of {args.reuse}")
    else:
        write_tokenizer(train_docs, args.vocab, out)
        print(f"== trained BPE vocab {args.vocab} in {time.time() - t0:.1f}s -> {out}")
    finish(data, out, train_docs, held_docs)


def write_tokenizer(train_docs, vocab, out):
    tok = build(train_docs, vocab)
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(
            {
                "add_bos_token": True,
                "add_eos_token": False,
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 8192,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            f,
            indent=2,
        )
        f.write("\n")


def write_index(path, docs, id_lists):
    index, pos = [], 0
    for doc, ids in zip(docs, id_lists):
        path_in_wheel = doc.split("\n", 1)[0][len("# file: "):]
        index.append({"path": path_in_wheel, "start": pos, "n_tokens": len(ids) + 2})
        pos += len(ids) + 2
    with open(path, "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")


def finish(data, out, train_docs, held_docs):
    # Reload from disk: everything below uses the saved file.
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    for i, s in SPECIAL_IDS.items():
        assert tok.token_to_id(s) == i, s
    chat_ids = tok.encode(CHAT_SAMPLE, add_special_tokens=False).ids
    assert chat_ids[:2] == [BOS, 105] and 106 in chat_ids, chat_ids
    assert tok.decode(chat_ids, skip_special_tokens=False) == CHAT_SAMPLE

    t0 = time.time()
    held_ids = encode_docs(tok, held_docs)
    check_roundtrip(tok, held_docs, held_ids)
    print(f"== held-out round trip exact on all {len(held_docs)} files")
    hf = check_hf(str(out), held_docs[:20])
    print(f"== transformers AutoTokenizer cross-check: {hf}")
    train_ids = encode_docs(tok, train_docs)
    # spot-check some training documents too
    check_roundtrip(tok, train_docs[::50], train_ids[::50])
    print(f"== tokenised corpus in {time.time() - t0:.1f}s")

    n_train = write_bin(data / "train.bin", train_ids)
    n_held = write_bin(data / "heldout.bin", held_ids)
    write_index(data / "heldout_index.json", held_docs, held_ids)
    n_unseen = 0
    if (data / "unseen.txt").is_file():
        unseen_docs = read_docs(data / "unseen.txt")
        unseen_ids = encode_docs(tok, unseen_docs)
        check_roundtrip(tok, unseen_docs, unseen_ids)
        n_unseen = write_bin(data / "unseen.bin", unseen_ids)
        write_index(data / "unseen_index.json", unseen_docs, unseen_ids)
        print(f"== unseen.bin {n_unseen} tokens ({len(unseen_docs)} files, round trip exact)")
    held_chars = sum(len(d) for d in held_docs)
    held_toks = sum(len(x) for x in held_ids)
    train_chars = sum(len(d) for d in train_docs)
    train_toks = sum(len(x) for x in train_ids)
    inner = [s for s in ("<eos>", "<bos>", "<pad>", "<|turn>", "<turn|>") if any(s in d for d in train_docs)]
    stats = {
        "vocab_size": tok.get_vocab_size(),
        "reserved_ids": N_RESERVED,
        "train_docs": len(train_docs),
        "heldout_docs": len(held_docs),
        "train_tokens_bin": n_train,
        "heldout_tokens_bin": n_held,
        "unseen_tokens_bin": n_unseen,
        "train_chars_per_token": train_chars / train_toks,
        "heldout_chars_per_token": held_chars / held_toks,
        "heldout_bytes_per_token": sum(len(d.encode()) for d in held_docs) / held_toks,
        "special_strings_seen_in_train_text": inner,
    }
    with open(data / "tokenizer_stats.json", "w") as f:
        json.dump(stats, f, indent=2)
        f.write("\n")
    print(f"== train.bin {n_train} tokens ({os.path.getsize(data / 'train.bin') / 1e6:.1f} MB), "
          f"heldout.bin {n_held} tokens")
    print(f"== chars/token: train {stats['train_chars_per_token']:.3f}, "
          f"held-out {stats['heldout_chars_per_token']:.3f}")
    if inner:
        print(f"== note: special-token strings occur as text in train docs (encoded as text): {inner}")


if __name__ == "__main__":
    main()
