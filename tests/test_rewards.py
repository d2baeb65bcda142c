"""Answer extraction, the math reward, and the reward pool's failure handling."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest

from asyncrl.rewards import (
    RewardLoadError,
    RewardPool,
    boxed_math_reward,
    extract_answer,
    last_boxed,
    math_reward,
    to_number,
)
from asyncrl.rewards import pool as pool_module
from asyncrl.workflows.loader import SpecError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("so the total is \\boxed{72}.", "72"),
        ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("nested \\boxed{\\sqrt{\\frac{1}{2}}} done", "\\sqrt{\\frac{1}{2}}"),
        ("She pays 3 + 4 = 7 dollars, so 7 * 2 = 14.", "14"),
        ("The answer is 1,250.", "1,250"),
        ("#### $1,000", "$1,000"),
        ("no digits at all", None),
        ("truncated \\boxed{12", "12"),  # unbalanced box: fall back to the last number
    ],
)
def test_extract_answer(text: str, expected: str | None):
    assert extract_answer(text) == expected


def test_last_boxed_handles_fbox_and_absence():
    assert last_boxed("\\fbox{5} and \\boxed{6}") == "6"
    assert last_boxed("nothing") is None


@pytest.mark.parametrize(
    ("answer", "value"),
    [
        ("72", Fraction(72)),
        ("72.0", Fraction(72)),
        ("-3.5", Fraction(-7, 2)),
        ("$1,000", Fraction(1000)),
        ("1/2", Fraction(1, 2)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\dfrac{1}{8}", Fraction(-1, 8)),
        ("18 dollars", Fraction(18)),
        ("50\\%", Fraction(50)),
        ("\\text{72}", Fraction(72)),
        ("x + 1", None),
        ("1,2,3", None),
    ],
)
def test_to_number(answer: str, value: Fraction | None):
    assert to_number(answer) == value


GSM_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"


@pytest.mark.parametrize(
    ("completion", "data", "reward"),
    [
        ("48 + 24 = 72\n#### 72", {"answer": GSM_SOLUTION}, 1.0),
        ("So she sold \\boxed{72} clips.", {"answer": GSM_SOLUTION}, 1.0),
        ("That is 72.00 in total.", {"answer": "72"}, 1.0),
        ("The answer is \\boxed{71}.", {"answer": GSM_SOLUTION}, 0.0),
        ("I do not know.", {"answer": "72"}, 0.0),
        ("half of it: \\boxed{\\frac{1}{2}}", {"answer": "0.5"}, 1.0),
        ("\\boxed{0.75}", {"answer": "\\boxed{\\frac{3}{4}}"}, 1.0),
        ("\\boxed{0.74}", {"answer": "3/4"}, 0.0),
        ("$\\boxed{\\frac{\\sqrt{2}}{2}}$", {"answer": "\\frac{1}{\\sqrt{2}}"}, 1.0),
        ("\\boxed{x^2 + 2x + 1}", {"answer": "(x+1)^2"}, 1.0),
        ("\\boxed{x^2 + 1}", {"answer": "(x+1)^2"}, 0.0),
    ],
)
def test_math_reward(completion: str, data: dict, reward: float):
    assert math_reward(completion, data) == reward


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("So \\boxed{72}.", 1.0),
        ("48 + 24 = 72", 0.0),  # right, but not in the format asked for
        ("72\n#### 72", 0.0),
        ("\\boxed{72} or rather \\boxed{71}", 0.0),  # the last box is the answer
        ("\\boxed{72", 0.0),  # cut before the box closed
    ],
)
def test_boxed_math_reward_counts_only_a_boxed_answer(completion: str, reward: float):
    assert boxed_math_reward(completion, {"answer": GSM_SOLUTION}) == reward
    assert boxed_math_reward(completion, {"answer": "72"}) == reward


def test_math_reward_without_reference_raises():
    with pytest.raises(KeyError, match="none of"):
        math_reward("\\boxed{1}", {"question": "?"})


USER_REWARDS = textwrap.dedent(
    """
    import os
    import time

    def contains_yes(completion, data):
        return 1.0 if "yes" in completion else 0.0

    def raises(completion, data):
        raise ValueError("bad input " + completion)

    def hangs(completion, data):
        if completion == "hang":
            time.sleep(3600)
        return 0.5

    def not_a_number(completion, data):
        return "high"

    def dies(completion, data):
        os._exit(3)

    async def async_reward(completion, data):
        return float(len(completion))
    """
)


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


async def test_pool_scores_math_in_workers_concurrently():
    async with RewardPool("math", workers=2, timeout=30.0) as pool:
        results = await asyncio.gather(
            pool.score("so \\boxed{72}", {"answer": GSM_SOLUTION}),
            pool.score("#### 70", {"answer": GSM_SOLUTION}),
            pool.score("\\boxed{\\frac{1}{2}}", {"answer": "0.5"}),
        )
    assert [r.reward for r in results] == [1.0, 0.0, 1.0]
    assert all(r.ok and r.reason == "" for r in results)
    assert pool.calls == 3 and not pool.failures


async def test_user_file_reward_and_async_reward(user_file: Path):
    async with RewardPool(f"{user_file}:contains_yes", workers=1, timeout=30.0) as pool:
        assert (await pool.score("yes!", {})).reward == 1.0
        assert (await pool.score("no", {})).reward == 0.0
    async with RewardPool(f"{user_file}:async_reward", workers=1, timeout=30.0) as pool:
        assert (await pool.score("abcd", {})).reward == 4.0


async def test_raising_reward_scores_zero_and_is_counted(user_file: Path):
    async with RewardPool(f"{user_file}:raises", workers=1, timeout=30.0) as pool:
        result = await pool.score("x", {})
        again = await pool.score("y", {})
    assert result.reward == 0.0 and not result.ok
    assert result.reason.startswith("raised: ValueError: bad input x")
    assert "my_rewards.py" in result.reason  # where it raised
    assert again.reason.startswith("raised: ValueError: bad input y")
    assert pool.failures == {"raised": 2}


async def test_hanging_reward_is_cut_at_its_timeout_and_the_worker_replaced(user_file: Path):
    async with RewardPool(f"{user_file}:hangs", workers=1, timeout=1.0) as pool:
        first = pool._workers[0].process
        hung = await pool.score("hang", {})
        assert hung.reward == 0.0 and not hung.ok
        assert hung.reason == "timeout: no result after 1s"
        assert await first.wait() == -9  # killed (SIGKILL), not left running
        fine = await pool.score("fine", {})  # served by the replacement worker
    assert fine.ok and fine.reward == 0.5
    assert pool.failures == {"timeout": 1}


async def test_bad_values_and_dying_workers(user_file: Path):
    async with RewardPool(f"{user_file}:not_a_number", workers=1, timeout=30.0) as pool:
        bad = await pool.score("x", {})
    assert not bad.ok and bad.reason.startswith("bad_value: returned str")
    async with RewardPool(f"{user_file}:dies", workers=1, timeout=30.0) as pool:
        died = await pool.score("x", {})
    assert not died.ok and died.reason.startswith("died: worker exited (code 3)")
    assert pool.failures == {"died": 1}


async def test_unloadable_rewards_fail_loudly(tmp_path: Path, user_file: Path):
    with pytest.raises(SpecError, match="does not exist"):
        RewardPool(f"{tmp_path}/missing.py:fn")
    with pytest.raises(SpecError, match="not of the form"):
        RewardPool("no_colon_here")
    pool = RewardPool(f"{user_file}:no_such_function", workers=1)
    try:
        with pytest.raises(RewardLoadError, match="no attribute 'no_such_function'"):
            await pool.start()
    finally:
        await pool.aclose()


def test_a_worker_whose_pool_went_away_exits_quietly() -> None:
    """A worker that starts (or answers) after its pool closed the pipe, as when the
    reward actor stops while a worker is still importing, exits 0 without a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the pool's end of the replies, already gone
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.entry.reward_worker", "asyncrl.rewards:math_reward"],
        stdin=subprocess.DEVNULL,
        stdout=write_end,
        stderr=subprocess.PIPE,
        timeout=60,
    )
    os.close(write_end)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr.decode()


async def test_closing_while_cancelled_calls_replace_their_workers_leaves_no_process(
    user_file: Path,
):
    """An actor that stops cancels its calls in flight; each cancelled call replaces its
    worker in a shielded task that outlives the cancellation. Closing the pool right then
    waits for every worker, the fresh ones too, and leaves none running (replacements
    that started after the close used to stay, idle on their stdin: orphans, and a
    close that waited on one never ended)."""
    spawned: list[asyncio.subprocess.Process] = []
    original = pool_module._Worker.spawn

    async def spawn(spec: str) -> pool_module._Worker:
        worker = await original(spec)
        spawned.append(worker.process)
        return worker

    pool = RewardPool(f"{user_file}:hangs", workers=2, timeout=60.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pool_module._Worker, "spawn", spawn)
        await pool.start()
        calls = [asyncio.create_task(pool.score("hang", {})) for _ in range(2)]
        await asyncio.sleep(0.5)  # both calls sent, both workers busy
        for call in calls:
            call.cancel()  # as an actor's stop does, closing the pool without waiting
        async with asyncio.timeout(30):
            await pool.aclose()
        await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.sleep(1.0)  # a replacement that was still starting has settled
    assert len(spawned) >= 2
    assert [p.returncode is not None for p in spawned] == [True] * len(spawned), spawned
