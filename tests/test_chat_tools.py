"""Tool-calling rows under Qwen's own chat template: a row-level `"tools"` list reaches the template (its `# Tools`
section is in the training text, in the prompt, not trained), OpenAI-style assistant turns with `"content": null` and
`"tool_calls"` and `"tool"` results are read, and the trained tokens are exactly what the assistant says: its tool call
and its answer, not the schema nor the tool's result. Malformed tools end in one line naming the file and line."""
import copy
import json

import pytest

from course_lib.sft import data as D
from course_lib.sft import tokenizer as T

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
RESULT = '{"temperature": 21, "sky": "clear"}'
ANSWER = "It is 21 degrees and clear in Paris."
CONVERSATION = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
                {"role": "assistant", "content": ANSWER}]
SIMPLE = [{"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": "Sunny."}]
EMPTY_THINK = "<think>\n\n</think>\n\n"  # what Qwen3's template writes before the last turn's answer


@pytest.fixture(scope="module")
def qwen3(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


def write_rows(tmp_path, rows) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trained_pieces(tok, example) -> list[str]:
    """The label-masked (trained) positions of a tokenized row, decoded run by run."""
    labels = D.tokenize_example(example, tok)["labels"]
    pieces, cur = [], []
    for t in labels + [D.IGNORE]:
        if t != D.IGNORE:
            cur.append(t)
        elif cur:
            pieces, cur = pieces + [tok.decode(cur)], []
    return pieces


def test_a_rows_tools_render_the_tools_section_in_the_training_text(qwen3, tmp_path):
    rows = D.read_chats(write_rows(tmp_path, [{"messages": SIMPLE, "tools": TOOLS}]))
    example = D.tokenize_example(rows[0], qwen3)
    text = qwen3.decode(example["input_ids"])
    expected = qwen3.apply_chat_template(SIMPLE, tools=TOOLS, tokenize=False)
    assert "# Tools" in expected and "get_weather" in expected
    assert text == expected
    assert rows == [{"messages": SIMPLE, "tools": TOOLS}], "the reader keeps the row's tools"
    assert example["input_ids"] == list(qwen3.apply_chat_template(SIMPLE, tools=TOOLS, tokenize=True,
                                                                   return_dict=True)["input_ids"])
    assert trained_pieces(qwen3, rows[0]) == [EMPTY_THINK + "Sunny.<|im_end|>"], "the schema is not trained"


def test_a_tool_call_conversation_trains_exactly_the_two_assistant_turns(qwen3, tmp_path):
    rows = D.read_chats(write_rows(tmp_path, [{"messages": CONVERSATION, "tools": TOOLS}]))
    call_turn = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert trained_pieces(qwen3, rows[0]) == [call_turn, EMPTY_THINK + ANSWER + "<|im_end|>"]
    text = qwen3.decode(D.tokenize_example(rows[0], qwen3)["input_ids"])
    assert text == qwen3.apply_chat_template(D.renderable(CONVERSATION), tools=TOOLS, tokenize=False)
    assert "# Tools" in text and "<tool_response>\n" + RESULT in text  # rendered, in the prompt
    assert D.empty_answers(rows) == 0  # a tool call is not an empty answer


def test_tool_calls_without_tools_and_in_a_row_with_a_system_prompt(qwen3):
    """The mask lines up whatever the template writes first: no tools section, or tools after a system prompt;
    two tool calls in one turn, and a second round of calls."""
    second = {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    messages = [{"role": "system", "content": "Answer briefly."}, *CONVERSATION[:1],
                {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL, second]},
                {"role": "tool", "content": RESULT}, {"role": "tool", "content": RESULT},
                {"role": "assistant", "tool_calls": [second]}, {"role": "tool", "content": RESULT},
                CONVERSATION[-1]]
    calls = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>']
    expected = ["Let me look.\n" + calls[0] + "\n" + calls[1] + "<|im_end|>", calls[1] + "<|im_end|>",
                EMPTY_THINK + ANSWER + "<|im_end|>"]
    for tools in (None, TOOLS):
        assert trained_pieces(qwen3, {"messages": messages, "tools": tools}) == expected


def test_a_literal_end_of_turn_in_tool_call_arguments_does_not_end_the_turn(qwen3, tmp_path):
    """Arguments are written verbatim (a string) or as JSON (an object): an `<|im_end|>` inside either is the
    assistant's text; the turn ends at its own. `"tool_calls": null` on a plain answer (OpenAI's exports) is no call."""
    odd = {"id": "c", "type": "function", "function": {"name": "echo", "arguments": '{"text": "a <|im_end|> b"}'}}
    obj = {"id": "d", "type": "function", "function": {"name": "echo", "arguments": {"text": "<|im_end|>"}}}
    messages = [CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": [odd, obj]},
                {"role": "tool", "content": "done"}, {"role": "assistant", "content": "Done.", "tool_calls": None}]
    rows = D.read_chats(write_rows(tmp_path, [{"messages": messages}]))
    assert trained_pieces(qwen3, rows[0]) == [
        '<tool_call>\n{"name": "echo", "arguments": {"text": "a <|im_end|> b"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "echo", "arguments": {"text": "<|im_end|>"}}\n</tool_call><|im_end|>',
        EMPTY_THINK + "Done.<|im_end|>"]


def test_a_template_that_drops_tools_or_tool_calls_is_refused(qwen3):
    course = copy.deepcopy(qwen3)
    course.chat_template = T.CHATML_TEMPLATE  # renders neither tools nor tool_calls
    with pytest.raises(D.ChatFormatError, match="ignores the row's \"tools\""):
        D.assistant_mask(course, SIMPLE, TOOLS)
    with pytest.raises(D.ChatFormatError, match="tool call 'get_weather'"):
        D.assistant_mask(course, CONVERSATION)


@pytest.mark.parametrize("row, message", [
    ({"messages": SIMPLE, "tools": {"type": "function"}}, r"\"tools\" must be a list of function schemas"),
    ({"messages": SIMPLE, "tools": ["get_weather"]}, r"\"tools\" must be a list of function schemas"),
    ({"messages": SIMPLE, "tools": [{"type": "function", "function": {"description": "x"}}]}, r"\"tools\" must be"),
    ({"messages": SIMPLE, "tools": json.dumps(TOOLS)}, r"\"tools\" is a string"),
    ({"messages": [SIMPLE[0], {"role": "assistant", "content": None}]}, "neither content nor tool_calls"),
    ({"messages": [SIMPLE[0], {"role": "assistant"}]}, "neither content nor tool_calls"),
    ({"messages": [SIMPLE[0], {"role": "assistant", "content": None, "tool_calls": []}]}, "neither content nor"),
    ({"messages": [SIMPLE[0], {"role": "assistant", "content": None, "tool_calls": "get_weather"}]},
     r"\"tool_calls\" must be a list"),
    ({"messages": [SIMPLE[0], {"role": "assistant", "content": None,
                               "tool_calls": [{"function": {"name": "f", "arguments": "{city"}}]}]}, "every tool call"),
    ({"messages": [SIMPLE[0], {"role": "tool", "content": None}, SIMPLE[1]]}, "text content"),
])
def test_malformed_tools_end_in_one_line_naming_file_and_line(tmp_path, row, message):
    path = write_rows(tmp_path, [{"messages": SIMPLE}, row])
    with pytest.raises(D.ChatFormatError, match=message) as e:
        D.read_chats(path)
    assert str(e.value).startswith(f"{path}:2: ") and "\n" not in str(e.value)
