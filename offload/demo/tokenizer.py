"""The demo tokenizer: byte-level BPE (any text encodes) trained here on a built-in word list.

`build_tokenizer(vocab) -> tokenizers.Tokenizer` is deterministic (fixed corpus, fixed seed);
`tokenizer_config(...)` is what transformers' `AutoTokenizer` needs to load tokenizer.json as a
fast tokenizer (plus a minimal chat template for /v1/chat/completions).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BOS, EOS = "<s>", "</s>"
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if more no "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three cache block prefix token "
    "store page layer model server request tier memory disk host device prefill decode read "
    "write offload index key value hit miss").split()
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def _corpus(seed: int = 0, lines: int = 2000) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(_WORDS) for _ in range(r.randint(8, 40))) + r.choice(".,?!")
            for _ in range(lines)]


def build_tokenizer(vocab: int) -> "Tokenizer":
    """A byte-level BPE of at most `vocab` tokens (BOS and EOS first). Deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def tokenizer_config(context: int) -> dict[str, Any]:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
            "pad_token": EOS, "add_bos_token": False, "add_eos_token": False,
            "model_max_length": context, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE}
