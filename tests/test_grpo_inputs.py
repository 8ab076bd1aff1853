"""GRPO's host side: the prompts file (mamba_train/data/prompts.py: string and chat prompts,
extra fields handed on, a deterministic split, an iterator that resumes exactly, one-line
errors for bad rows) and the reward functions (mamba_train/train/rewards.py: the built-ins,
loading by import path with weights, None as TRL treats it, a raising function and a wrong
return each named in one line)."""

import json
import textwrap

import numpy as np
import pytest

from mamba_train.data import chat, prompts
from mamba_train.errors import UserError
from mamba_train.train import rewards
from mamba_train.workdir import checkpoint

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}]


def _write(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def _prompt_file(tmp_path, n=20):
  rows = []
  for i in range(n):
    if i % 2:
      rows.append({"prompt": f"Q{i}: {i} + 1 = ?\nA:", "answer": str(i + 1), "id": i})
    else:
      rows.append({"prompt": CHAT[:1] + [{"role": "user", "content": f"{i} + 1?"}], "answer": str(i + 1), "id": i,
                   **({"source": "gsm"} if i == 4 else {})})
  return _write(tmp_path / "prompts.jsonl", rows)


def test_string_and_chat_prompts_render_and_fields_pass_through(tmp_path):
  path = _prompt_file(tmp_path)
  got = prompts.load_prompts(path, eval_fraction=0.0)
  assert got.field_names == ("answer", "id", "source") and got.template == "default" and not got.eval
  by_id = {p.fields["id"]: p for p in got.train}
  assert by_id[1].text == "Q1: 1 + 1 = ?\nA:" and by_id[1].prompt == by_id[1].text
  template = chat.compile_template(chat.DEFAULT_TEMPLATE)
  assert by_id[0].text == template.render(messages=by_id[0].prompt, add_generation_prompt=True,
                                          eos_token="<|endoftext|>")
  # What SFT renders before the assistant turn of the same conversation.
  pieces = chat.render(template, by_id[0].prompt + [{"role": "assistant", "content": "1"}], "<|endoftext|>")
  assert by_id[0].text == "".join(t for t, learn in pieces[:-1]) and pieces[-1][1]
  assert by_id[0].text.endswith("<|user|>\n0 + 1?<|assistant|>\n")
  assert list(by_id[1].ids) == list(by_id[1].text.encode())  # byte tokenizer: ids are the bytes
  batch = [by_id[4], by_id[1]]
  ps, fields = prompts.reward_inputs(batch, got.field_names, group_size=2)
  assert ps == [by_id[4].prompt] * 2 + [by_id[1].prompt] * 2
  assert fields == {"answer": ["5", "5", "2", "2"], "id": [4, 4, 1, 1], "source": ["gsm", "gsm", None, None]}


def test_split_is_deterministic_and_disjoint(tmp_path):
  path = _prompt_file(tmp_path)
  ids = lambda ps: [p.fields["id"] for p in ps]
  a = prompts.load_prompts(path, eval_fraction=0.25, seed=3)
  b = prompts.load_prompts(path, eval_fraction=0.25, seed=3)
  c = prompts.load_prompts(path, eval_fraction=0.25, seed=4)
  assert ids(a.eval) == ids(b.eval) and ids(a.train) == ids(b.train) and len(a.eval) == 5
  assert sorted(ids(a.train) + ids(a.eval)) == list(range(20)) and ids(a.eval) != ids(c.eval)
  assert [len(x) for x in prompts.eval_batches(a.eval, 2)] == [2, 2, 1]


def test_iterator_resumes_exactly_through_the_checkpointers_json_state(tmp_path):
  train = prompts.load_prompts(_prompt_file(tmp_path, n=7)).train
  ids = lambda batch: [p.fields["id"] for p in batch]
  it = prompts.PromptIterator(train, batch_size=3, seed=5)
  first = [ids(next(it)) for _ in range(5)]  # 15 prompts: two epochs and a batch across each boundary
  assert sorted(sum(first, [])[:7]) == list(range(7)) and sum(first, [])[:7] != sum(first, [])[7:14]
  it = prompts.PromptIterator(train, batch_size=3, seed=5)
  assert [ids(next(it)) for _ in range(2)] == first[:2]
  saved = checkpoint._grain_item(it).get_state()  # what the Checkpointer writes: JSON bytes
  state = json.loads(saved)
  assert set(state) >= {"epoch", "position", "seed"} and state["epoch"] == 0 and state["position"] == 6
  resumed = prompts.PromptIterator(train, batch_size=3, seed=99)  # the saved seed wins
  checkpoint._grain_item(resumed).set_state(saved)
  assert [ids(next(resumed)) for _ in range(3)] == first[2:]
  other = prompts.PromptIterator(train[1:], batch_size=3, seed=5)
  with pytest.raises(UserError, match="same prompts file"):
    other.set_state(state)


@pytest.mark.parametrize("row,says", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "needs a 'prompt'"),
    ({"question": "x"}, "needs a 'prompt'"),
    ({"prompt": "  "}, "'prompt' is empty"),
    ({"prompt": 3}, "must be a string or a non-empty list"),
    ({"prompt": [{"role": "bot", "content": "x"}]}, "role 'bot'"),
    ({"prompt": [{"role": "user"}]}, "no string 'content'"),
    ({"prompt": CHAT + [{"role": "assistant", "content": "5"}]}, "ends with an assistant message"),
    ({"prompt": "x", "completions": "y"}, "'completions' is a name reward functions are called with"),
])
def test_bad_rows_are_one_line_errors_naming_file_and_line(tmp_path, row, says):
  path = _write(tmp_path / "bad.jsonl", [{"prompt": "fine", "answer": "1"}, row])
  with pytest.raises(prompts.PromptFormatError) as e:
    prompts.read_prompts(path)
  msg = str(e.value)
  assert msg.startswith(f"{path}, line 2: ") and says in msg and "\n" not in msg, msg


def test_unreadable_empty_and_too_long_files_are_clear_errors(tmp_path):
  with pytest.raises(prompts.PromptFormatError, match="cannot be read"):
    prompts.read_prompts(str(tmp_path / "missing.jsonl"))
  with pytest.raises(prompts.PromptFormatError, match="no prompts"):
    prompts.read_prompts(_write(tmp_path / "empty.jsonl", ["", " "]))
  path = _write(tmp_path / "long.jsonl", [{"prompt": "short"}, {"prompt": "x" * 50}])
  with pytest.raises(prompts.PromptFormatError, match=r"1 prompts are longer than max_prompt_tokens=10, the "
                     r"first at line 2 \(50 tokens\)"):
    prompts.load_prompts(path, max_prompt_tokens=10)
  (tmp_path / "bytes.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
  with pytest.raises(prompts.PromptFormatError, match="line 2: not valid UTF-8"):
    prompts.read_prompts(str(tmp_path / "bytes.jsonl"))


# ---------------------------------------------------------------------------
# Reward functions.

USER_MODULE = textwrap.dedent('''
    def brevity(prompts, completions, **kwargs):
      return [1.0 / (1 + len(c if isinstance(c, str) else c[0]["content"])) for c in completions]

    def only_gsm(prompts, completions, source, **kwargs):
      return [1.0 if s == "gsm" else None for s in source]

    def picky(prompts, completions, **kwargs):
      for p in prompts:
        if "boom" in p:
          raise ValueError("cannot score\\nthis one")
      return [0.0] * len(completions)

    def short(prompts, completions, **kwargs):
      return [0.0]

    def words(prompts, completions, **kwargs):
      return ["good"] * len(completions)

    def strict(prompts, completions, answer):
      return [0.0] * len(completions)
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text(USER_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  return "my_rewards"


def test_builtins():
  done = "<think>add</think> so #### 1,000."
  assert rewards.exact_answer([""] * 4, [done, "#### 999", "1000", [{"role": "assistant", "content": "####1000"}]],
                              answer=["1000", "1000", "1000", "1000"]) == [1.0, 0.0, 0.0, 1.0]
  assert rewards.exact_answer(["", ""], ["#### x", "#### Paris"], answer=[None, " paris"]) == [None, 0.0]
  assert rewards.think_format(["", "", ""], [done, "no think", "<think>a<think>b</think>c"]) == [1.0, 0.0, 0.0]
  assert rewards.length_penalty([""] * 4, [""] * 4, completion_ids=[[0] * 8, [0] * 9, [0] * 10, [0] * 11],
                                max_completion_length=10) == [0.0, -0.5, -1.0, -1.0]


def test_load_by_import_path_with_weights_and_none_as_trl(user_module):
  funcs = rewards.load_reward_funcs(f"{user_module}:brevity*0.5, {user_module}:only_gsm,"
                                    "mamba_train.train.rewards:exact_answer*2")
  assert [(f.name, f.weight) for f in funcs] == [("my_rewards:brevity", 0.5), ("my_rewards:only_gsm", 1.0),
                                                 ("mamba_train.train.rewards:exact_answer", 2.0)]
  rewards.check_fields(funcs, ["answer", "source"])
  per_func = rewards.score(funcs, ["p1", "p2", "p3"], ["#### 4", "abc", "#### 7"],
                           {"answer": ["4", "5", None], "source": ["gsm", None, None]})
  want = np.array([[1 / 7, 1.0, 1.0], [1 / 4, np.nan, 0.0], [1 / 7, np.nan, np.nan]], np.float32)
  np.testing.assert_allclose(per_func, want, rtol=1e-6)
  total = rewards.combine(per_func, [f.weight for f in funcs])
  np.testing.assert_allclose(total, [0.5 / 7 + 1 + 2, 0.5 / 4, 0.5 / 7], rtol=1e-6)
  assert np.isnan(rewards.combine(np.array([[np.nan, np.nan], [1.0, np.nan]], np.float32), [1, 1])).tolist() \
      == [True, False]
  metrics = rewards.reward_metrics(funcs, per_func)
  np.testing.assert_allclose(metrics["rewards/my_rewards:only_gsm/mean"], 1.0)
  assert np.isnan(metrics["rewards/my_rewards:only_gsm/std"])  # one value: TRL's nanstd is NaN
  np.testing.assert_allclose(metrics["rewards/mamba_train.train.rewards:exact_answer/std"], np.std([1, 0], ddof=1))
  np.testing.assert_allclose(metrics["reward"], np.mean(total), rtol=1e-6)
  assert [f.weight for f in rewards.load_reward_funcs([f"{user_module}:brevity*3"], weights=[0.25])] == [0.25]


def test_bad_specs_and_signatures_are_one_line_errors(user_module):
  for spec, says in [("my_rewards.brevity", "expected 'package.module:function'"),
                     ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
                     ("my_rewards:nope", "has no attribute 'nope'"),
                     ("my_rewards:brevity*heavy", "weight 'heavy' is not a number"),
                     ("", "no reward functions")]:
    with pytest.raises(rewards.RewardError, match=says):
      rewards.load_reward_funcs(spec)
  with pytest.raises(rewards.RewardError, match="my_rewards:only_gsm needs field 'source'"):
    rewards.check_fields(rewards.load_reward_funcs("my_rewards:only_gsm"), ["answer"])
  with pytest.raises(rewards.RewardError, match="my_rewards:strict takes no 'completion_ids' keyword"):
    rewards.check_fields(rewards.load_reward_funcs("my_rewards:strict"), ["answer"])


def test_a_raising_or_misbehaving_function_stops_with_one_line_naming_it(user_module):
  ps = ["fine", "this goes boom", "fine too"]
  with pytest.raises(rewards.RewardError) as e:
    rewards.score(rewards.load_reward_funcs("my_rewards:brevity,my_rewards:picky"), ps, ["a", "b", "c"])
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("reward function my_rewards:picky raised ValueError: cannot score "
                                            "this one on prompt 'this goes boom' (completion 1)"), msg
  for name, says in [("short", "returned 1 rewards for 3 completions"),
                     ("words", "returned 'good' for completion 0 (prompt 'fine')")]:
    with pytest.raises(rewards.RewardError) as e:
      rewards.score(rewards.load_reward_funcs(f"my_rewards:{name}"), ps, ["a", "b", "c"])
    assert str(e.value).startswith(f"reward function my_rewards:{name} {says}") and "\n" not in str(e.value)
