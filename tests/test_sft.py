"""The SFT pieces of chapters 09-10: the loss mask on one example, the checkpoint-directory check, and the recipe's
loss (course_lib/recipes/sft.py). Its launches under DDP, FSDP2 and DeepSpeed ZeRO-3 are in test_speed.py."""
import json

import pytest
import torch

from course_lib.sft import data as D
from course_lib.sft import model_dir as T
from course_lib.recipes import sft

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, tie_word_embeddings=True)


def corpus(rows):
    return [f"user\n{r['messages'][0]['content']}\nassistant\n{r['messages'][1]['content']}\n" for r in rows]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    D.write_task(root / "data", n_train=256, n_eval=8)
    train, _ = D.make_examples(n_train=256, n_eval=8)
    base = T.make_tiny_checkpoint(root / "base", corpus(train), TINY, vocab_size=300)
    return root, base


def test_loss_mask_covers_exactly_the_assistant_answer(task):
    _, base = task
    _, tok = T.load_model(base)
    example = {"messages": [{"role": "user", "content": "Reverse 5677693"}, {"role": "assistant", "content": "3967765"}]}
    ids, mask = D.assistant_mask(tok, example["messages"])
    assert (ids, mask) == D.prefix_mask(tok, example["messages"])  # the template's mask = the prefix rule
    trained = [t for t, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "3967765<|im_end|>"
    assert tok.decode(ids[:mask.index(1)]).endswith("<|im_start|>assistant\n")
    assert all(c == 1 for c in mask[mask.index(1):len(mask) - 1]) and mask[-1] == 0  # the final "\n" is not trained
    row = D.tokenize_example(example, tok, max_len=64)
    assert [lab for lab in row["labels"] if lab != D.IGNORE] == trained
    assert [t for t in tok.convert_ids_to_tokens(ids) if len(t) == 1 and t.isdigit()][:7] == list("5677693")  # one token a digit


def test_bad_model_path_gives_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory") as err:
        T.check_model_dir(tmp_path / "nope")
    assert "config.json" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="missing tokenizer.json, tokenizer_config.json, \\*.safetensors"):
        T.check_model_dir(tmp_path)


def test_packing_keeps_every_token_and_restarts_positions(task):
    _, base = task
    _, tok = T.load_model(base)
    train, _ = D.make_examples(n_train=20, n_eval=1)
    from datasets import Dataset

    rows = D.tokenize_dataset(Dataset.from_list(train), tok, 64)
    packed = D.pack(rows, 128)
    assert all(len(r["input_ids"]) == 128 for r in packed)
    kept = sum(sum(lab != D.IGNORE for lab in r["labels"]) for r in packed)
    assert kept == sum(sum(lab != D.IGNORE for lab in r["labels"]) for r in rows)
    assert packed[0]["position_ids"][0] == 0 and packed[0]["position_ids"].count(0) >= 2
    # restarting position_ids keeps attention inside each example: the second one's logits are its own
    model, _ = T.load_model(base)
    first, second = rows[0]["input_ids"], rows[1]["input_ids"]
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([second])).logits[0]
        joined = model(input_ids=torch.tensor([first + second]),
                       position_ids=torch.tensor([list(range(len(first))) + list(range(len(second)))])).logits[0]
    assert (joined[len(first):] - alone).abs().max() < 1e-5


@pytest.mark.parametrize("mask_keep", sorted({False, sft.MASK_KEEP}))  # True where this transformers slices by mask
def test_recipe_loss_equals_the_models_loss(task, monkeypatch, mask_keep):
    """transformers 5.17 indexes the sequence axis with `logits_to_keep` (a (batch, seq) mask fails there, as it did
    on a GPU machine with 5.17); the recipe then computes every position's logits and masks them: the same loss."""
    _, base = task
    model, tok = T.load_model(base)
    train, _ = D.make_examples(n_train=8, n_eval=1)
    batch = D.collate([D.tokenize_example(r, tok, 64) for r in train], tok.pad_token_id)
    monkeypatch.setattr(sft, "MASK_KEEP", mask_keep)
    assert sft.sft_loss(model, batch).item() == pytest.approx(model(**batch).loss.item(), rel=1e-6)




CHAT = {"messages": [{"role": "user", "content": "Reverse 12"}, {"role": "assistant", "content": "21"}]}


def test_jsonl_lines_end_at_newline_only_and_a_bom_is_skipped(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 (`json.dumps(..., ensure_ascii=False)` writes them as they are):
    they are not line ends. A UTF-8 byte order mark (Windows editors write one) is skipped; a byte that is not UTF-8
    is named by file and line."""
    odd = {"messages": [{"role": "user", "content": "a\u2028b\u2029c\u0085d"}, {"role": "assistant", "content": "e\u2028f"}]}
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(CHAT) + "\n" + json.dumps(odd, ensure_ascii=False) + "\r\n").encode())
    assert D.read_chats(path) == [CHAT, odd]
    path.write_bytes(json.dumps(CHAT).encode() + b"\n\n" + b'{"messages": "caf\xe9"}\n')
    with pytest.raises(D.ChatFormatError, match=r"train.jsonl:3: not UTF-8 \(byte 0xe9"):
        D.read_chats(path)


@pytest.fixture(scope="module")
def qwen25(qwen_tokenizer_dir):
    """Qwen's own tokenizer with Qwen2.5-Instruct's template, which writes a default system prompt when none is given."""
    from test_chat_masks import QWEN25_TEMPLATE
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    tok.chat_template = QWEN25_TEMPLATE
    return tok


def trained_text(tok, messages) -> list[str]:
    ids, mask = D.assistant_mask(tok, messages)
    assert ids == list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    pieces, current = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            current.append(t)
        elif current:
            pieces, current = pieces + [tok.decode(current)], []
    return pieces


def test_a_conversation_opened_by_the_assistant_trains_its_answer_not_the_default_system_prompt(qwen25):
    messages = [{"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "Reverse 12"},
                {"role": "assistant", "content": "21"}]
    assert "You are Qwen" in qwen25.apply_chat_template(messages, tokenize=False)
    assert trained_text(qwen25, messages) == ["Hello, how can I help?<|im_end|>", "21<|im_end|>"]


def test_a_literal_end_of_turn_token_inside_the_content_does_not_end_the_turn(qwen25):
    messages = [{"role": "user", "content": "What ends a turn in ChatML?"},
                {"role": "assistant", "content": "The token <|im_end|>, then a newline."},
                {"role": "user", "content": "And <|im_end|> in a question?"}, {"role": "assistant", "content": "The same."}]
    assert trained_text(qwen25, messages) == ["The token <|im_end|>, then a newline.<|im_end|>", "The same.<|im_end|>"]


def test_empty_assistant_turns_are_counted(qwen25):
    empty = {"messages": [{"role": "user", "content": "Say nothing"}, {"role": "assistant", "content": " "}]}
    assert trained_text(qwen25, empty["messages"]) == [" <|im_end|>"]
    _, stats = D.tokenize_chats([CHAT, empty, empty], qwen25, 64)
    assert stats["empty_answers"] == 2


# --- the held-out loss under several ranks -----------------------------------------------------------------------
def held_out_rows(n: int = 9) -> list[dict]:
    """`n` tokenized rows of different lengths and trained tokens (an odd number: two ranks cannot split it evenly)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 50, (6 + 3 * i,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [D.IGNORE] * (2 + i % 3) + ids[2 + i % 3:]})
    return rows


def token_loss(model, batch):
    """A per-token mean over the trained positions, as the recipe's loss is: each row weighs by its trained tokens."""
    keep = batch["labels"][:, 1:] != D.IGNORE
    return model(batch["input_ids"])[:, :-1, 0][keep].mean()


def _held_out_rank(rank: int, world: int, store_path: str, out: str):
    import torch.distributed as dist

    from course_lib.parallel.dist import Context
    from course_lib.sft import evaluation as E

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model, calls = torch.nn.Embedding(50, 1), []
    loss = E.held_out_loss(model, held_out_rows(), lambda m, b: calls.append(1) or token_loss(m, b), 2, 0,
                           Context(rank, world, rank, torch.device("cpu")))
    torch.save({"loss": loss, "forwards": len(calls)}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_held_out_loss_scores_every_conversation_once_under_any_number_of_ranks(tmp_path):
    """9 held-out rows on 2 ranks: 5 and 4 of them, the same number of forwards on each rank (a sharded model's
    all-gathers need every rank), and the loss of one process over all 9 (not of 8: the remainder is not dropped)."""
    import torch.multiprocessing as mp

    from course_lib.parallel.dist import Context
    from course_lib.sft import evaluation as E

    assert [list(E.share_of(9, r, 2)) for r in range(2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert sorted(i for r in range(8) for i in E.share_of(9, r, 8)) == list(range(9))
    torch.manual_seed(0)
    model = torch.nn.Embedding(50, 1)
    one = E.held_out_loss(model, held_out_rows(), token_loss, 2, 0, Context(0, 1, 0, torch.device("cpu")))
    eight = E.held_out_loss(model, held_out_rows()[:8], token_loss, 2, 0, Context(0, 1, 0, torch.device("cpu")))
    assert abs(one - eight) > 1e-3  # the ninth row moves the loss: dropping it would show
    mp.spawn(_held_out_rank, args=(2, str(tmp_path / "store"), str(tmp_path / "r")), nprocs=2)
    ranks = [torch.load(tmp_path / f"r.{r}") for r in range(2)]
    assert [r["forwards"] for r in ranks] == [3, 3]  # 5 rows in 3 micro-batches of 2; 4 rows in 2, plus one not counted
    assert all(r["loss"] == pytest.approx(one, rel=1e-6) for r in ranks)


# --- the data formats practitioners have: each trains exactly as its `messages` equivalent ----------------------
CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse 5677693"},
                  {"role": "assistant", "content": "3967765"}, {"role": "user", "content": "Copy 12"},
                  {"role": "assistant", "content": "12"}]},
    {"messages": [{"role": "user", "content": "Sort 4312"}, {"role": "assistant", "content": "1234"}]},
]
SHAREGPT = [{"system": "Be brief.", "conversations": [{"from": "human", "value": "Reverse 5677693"},
                                                      {"from": "gpt", "value": "3967765"},
                                                      {"from": "human", "value": "Copy 12"}, {"from": "gpt", "value": "12"}]},
            {"conversations": [{"from": "human", "value": "Sort 4312"}, {"from": "gpt", "value": "1234"}]}]
PROMPT_COMPLETION = [{"prompt": c["messages"][:-1], "completion": c["messages"][-1:]} for c in CHATS]  # TRL's
PLAIN = [{"prompt": "Sort 4312", "completion": "1234"}]  # TRL's plain strings: one user turn, one assistant turn


def write_rows(rows, path):
    if path.suffix == ".jsonl":
        D.write_jsonl(rows, path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
@pytest.mark.parametrize("rows, chats", [(CHATS, CHATS), (SHAREGPT, CHATS), (PROMPT_COMPLETION, CHATS),
                                         (PLAIN, CHATS[1:])], ids=["messages", "sharegpt", "prompt_completion", "plain"])
def test_every_format_trains_the_same_tokens_and_masks_as_its_messages(task, tmp_path, rows, chats, suffix):
    _, base = task
    _, tok = T.load_model(base)
    read = D.read_data(write_rows(rows, tmp_path / f"train{suffix}"))
    assert read == chats  # converted once, to the same messages
    assert D.tokenize_chats(read, tok, 64) == D.tokenize_chats(chats, tok, 64)
    assert D.data_files(tmp_path) == ([tmp_path / f"train{suffix}"], [])
    assert D.data_files(tmp_path / f"train{suffix}") == ([tmp_path / f"train{suffix}"], [])


def test_anything_else_is_one_line_naming_the_file_and_its_keys(tmp_path):
    path = write_rows([{"instruction": "Reverse 12", "output": "21"}], tmp_path / "alpaca.json")
    with pytest.raises(D.ChatFormatError) as err:
        D.read_data(path)
    assert str(err.value).startswith(f"{path}: row 1: not a conversation") and "'instruction', 'output'" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(D.ChatFormatError, match=r"train.jsonl:1: ShareGPT turn from 'bot'"):
        D.read_data(write_rows([{"conversations": [{"from": "bot", "value": "x"}]}], tmp_path / "train.jsonl"))
    (tmp_path / "chats.csv").write_text("prompt,completion\n")
    with pytest.raises(D.ChatFormatError, match=r"chats.csv: not a data file \(read: .jsonl, .json, .parquet\)"):
        D.data_files(tmp_path / "chats.csv")


def test_eval_split_holds_out_a_seeded_fraction_of_one_file(tmp_path):
    from types import SimpleNamespace

    rows = [{"messages": [{"role": "user", "content": f"Copy {i}"}, {"role": "assistant", "content": str(i)}]}
            for i in range(40)]
    path = write_rows(rows, tmp_path / "chats.parquet")
    cfg = SimpleNamespace(data_dir=str(path), eval_split=0.25, eval_n=200, seed=3)
    train, held, split = sft.read_split(cfg)
    assert (len(train), len(held), split) == (30, 10, 10) and sft.read_split(cfg) == (train, held, split)
    assert sorted(map(str, train + held)) == sorted(map(str, rows))
    write_rows(rows[:4], tmp_path / "eval.jsonl")
    write_rows(rows, tmp_path / "train.jsonl")
    with pytest.raises(D.ChatFormatError, match="--eval-split 0.25 holds out part of the training data, but .*eval.jsonl"):
        sft.read_split(SimpleNamespace(**{**vars(cfg), "data_dir": str(tmp_path)}))
