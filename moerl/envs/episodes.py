"""Multi-turn episodes on the rollout engine: a sequence parks while its environment works and resumes
with the observation appended; the engine keeps decoding the other sequences meanwhile.

``EpisodeEngine`` wraps a ``moerl.rollout.Engine`` and offers the engine's interface to the rollout
worker (``add_request``, ``step``, ``update_weights``, ``version``, ``num_slots``, ``num_unfinished``):
one request of ``n`` samples becomes ``n`` episodes, and each finished episode comes out of ``step()``
as one ``EpisodeCompletion``. An episode:

    reset(task) -> observation o_0 = the prompt (P tokens)
    turn t: the engine generates a_t until a stop token        loss_mask 1, behaviour log-probs kept
            -> park: the action text goes to the environment (an ``EnvPool``), the slot is freed
            <- step(a_t) = (o_{t+1}, r_t, done, info)
            resume: o_{t+1} is appended (loss_mask 0, log-prob 0) and the next turn is admitted
    until done, ``max_turns`` turns or ``max_tokens`` response tokens.

Parking frees the sequence's KV slot; resuming admits the whole context (prompt, actions and
observations) as a new engine request, which prefills it again (recompute, as vLLM does after a
preemption), so parked episodes hold no cache memory and the number of episodes waiting on
environments is not bounded by the slots. Every generated token keeps its behaviour log-prob and the
policy version that computed it; observation tokens carry the version of the turn they answer.

Faults: an episode whose environment call errs ends its whole request (group): the request id is
reported once by ``pop_failed()`` and its other episodes are cancelled (their turns in the engine run
out and are discarded). The rollout worker hands the group's lease back (``moerl.runtime.episode_worker``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from moerl.envs.pool import CLOSE, RESET, STEP, EnvCall, EnvReply
from moerl.rollout import Completion, Engine, InvalidRequestError, Request
from moerl.tasks.base import Prompt, stable_hash


@dataclass(slots=True)
class EpisodeCompletion(Completion):
    """A finished episode as a completion: ``token_ids`` are all response tokens (actions and
    observations, length R); ``policy_mask`` marks the policy's own tokens (the loss mask)."""

    policy_mask: list[int] = field(default_factory=list)
    """1 for tokens the policy generated, 0 for observation tokens; length R."""
    reward: float = 0.0
    """Sum of the environment's per-turn rewards."""
    reward_info: dict[str, float] = field(default_factory=dict)
    """The last turn's info plus ``turns`` (policy turns) and ``env_s`` (seconds spent waiting on the env)."""

    @property
    def loss_mask(self) -> list[int]:
        """``policy_mask``: observation tokens never enter the loss."""
        return list(self.policy_mask)


@dataclass(slots=True)
class _Episode:
    key: str  # "<request id>|<sample index>"
    request: Request
    sample_index: int
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    env_s: float = 0.0
    is_parked: bool = True

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids


class EpisodeEngine:
    """Episodes of an environment over an ``Engine`` (see the module docstring).

    Args:
        engine: the rollout engine.
        pool: an ``EnvPool`` (``submit(EnvCall)``, ``poll(timeout_s) -> list[EnvReply]``, ``stats``).
        encode, decode: the tokenizer's text <-> ids.
        max_turns: most policy turns per episode.
        max_tokens: most response tokens (actions + observations) per episode.
        turn_stop_ids: token ids that end a turn besides the request's own stop ids.
        idle_wait_s: how long ``step()`` waits for an environment when the engine has nothing to decode.
    """

    def __init__(
        self,
        engine: Engine,
        pool,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        *,
        max_turns: int,
        max_tokens: int,
        turn_stop_ids: tuple[int, ...] = (),
        idle_wait_s: float = 0.005,
    ) -> None:
        self.engine, self.pool, self.encode, self.decode = engine, pool, encode, decode
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.turn_stop_ids = tuple(turn_stop_ids)
        self.idle_wait_s = idle_wait_s
        self.stats = pool.stats
        self.decode_steps = 0
        """Engine steps taken with sequences to decode (the parked-sequence test counts them)."""
        self._tasks: dict[str, Prompt] = {}  # request id -> its task, bound before add_request
        self._episodes: dict[str, _Episode] = {}  # key -> live episode
        self._turns: dict[str, _Episode] = {}  # engine request id of a turn -> episode
        self._failed: dict[str, str] = {}  # request id -> why (not yet reported)

    # -- the Engine interface the rollout worker uses
    @property
    def version(self) -> int:
        """Policy version of the engine's weights."""
        return self.engine.version

    @property
    def num_slots(self) -> int:
        """Concurrent episodes the worker should keep (the engine's slots)."""
        return self.engine.num_slots

    @property
    def num_unfinished(self) -> int:
        """Episodes in flight (parked or generating)."""
        return len(self._episodes)

    @property
    def num_parked(self) -> int:
        """Episodes waiting on their environment."""
        return sum(e.is_parked for e in self._episodes.values())

    def running_by_request(self) -> dict[str, list]:
        """What the worker's drain report reads: no running prefixes to hand on (parked episodes hold no
        slot; a drained episode starts over)."""
        return {}

    def update_weights(self, named_tensors, version: int) -> None:
        """``Engine.update_weights``: later turns (and the rest of running ones) use the new weights."""
        self.engine.update_weights(named_tensors, version)

    def bind_task(self, request_id: str, task: Prompt) -> None:
        """The task the request's episodes reset their environments with (call before ``add_request``)."""
        self._tasks[request_id] = task

    def add_request(self, request: Request) -> None:
        """Start ``request.params.n`` episodes of the task bound to ``request.request_id``.

        Raises:
            InvalidRequestError: no task bound, or the id is already in flight.
        """
        task = self._tasks.pop(request.request_id, None)
        if task is None:
            raise InvalidRequestError(request.request_id, "no task bound (EpisodeEngine.bind_task)")
        if any(e.request.request_id == request.request_id for e in self._episodes.values()):
            raise InvalidRequestError(request.request_id, "a request with this id is already in flight")
        for i in range(request.params.n):
            ep = _Episode(f"{request.request_id}|{i}", request, i)
            self._episodes[ep.key] = ep
            self.pool.submit(EnvCall(ep.key, RESET, task))

    def step(self) -> list[Completion]:
        """Apply environment answers, take one engine step, park the episodes whose turn ended.

        Returns:
            Episodes that finished (``EpisodeCompletion``, in no particular order).
        """
        idle = self.engine.num_unfinished == 0
        done: list[Completion] = []
        for reply in self.pool.poll(self.idle_wait_s if idle else 0.0):
            done += self._on_reply(reply)
        if self.engine.num_unfinished:
            if self.num_parked:
                self.stats.decode_steps_parked += 1
            self.decode_steps += 1
            for c in self.engine.step():
                ep = self._turns.pop(c.request_id)
                if ep.key in self._episodes:
                    done += self._on_turn(ep, c)
        self.stats.parked_max = max(self.stats.parked_max, self.num_parked)
        return done

    def pop_failed(self) -> dict[str, str]:
        """Requests (groups) ended by an environment fault since the last call, with the reason."""
        out, self._failed = self._failed, {}
        return out

    def cancel(self, request_id: str) -> None:
        """Forget the request's episodes (their environments are closed, running turns discarded)."""
        for key in [k for k, e in self._episodes.items() if e.request.request_id == request_id]:
            del self._episodes[key]
            self.pool.submit(EnvCall(key, CLOSE))

    # -- episode transitions
    def _on_reply(self, reply: EnvReply) -> list[Completion]:
        ep = self._episodes.get(reply.episode)
        if ep is None:
            return []
        ep.env_s += reply.latency_s
        if reply.error is not None:
            rid = ep.request.request_id
            self._failed.setdefault(rid, f"{reply.error}: {reply.message}")
            self.cancel(rid)
            return []
        if reply.kind == RESET:
            ep.prompt_ids = self.encode(reply.value)
            return self._resume(ep)
        obs, reward, is_done, info = reply.value
        ep.reward += reward
        ep.info = dict(info)
        if is_done or ep.turns >= self.max_turns:
            return [self._finish(ep, "stop" if is_done else "length")]
        obs_ids = self.encode(obs)
        ep.token_ids += obs_ids
        ep.logprobs += [0.0] * len(obs_ids)
        ep.versions += [ep.versions[-1] if ep.versions else self.version] * len(obs_ids)
        ep.mask += [0] * len(obs_ids)
        return self._resume(ep)

    def _resume(self, ep: _Episode) -> list[Completion]:
        """Admit the episode's next turn with its whole context; ends it when no room is left."""
        params = ep.request.params
        room = min(
            params.max_new_tokens,
            self.max_tokens - len(ep.token_ids),
            self.engine.max_seq_len - len(ep.context),
        )
        if room < 1 or not ep.prompt_ids:
            return [self._finish(ep, "length")]
        turn_id = f"{ep.key}|{ep.turns}"
        seed = stable_hash(f"{params.seed}:{ep.sample_index}:{ep.turns}") & ((1 << 63) - 1)
        turn_params = replace(
            params,
            n=1,
            max_new_tokens=room,
            seed=seed,
            stop_token_ids=tuple(dict.fromkeys((*params.stop_token_ids, *self.turn_stop_ids))),
        )
        self.engine.add_request(Request(request_id=turn_id, prompt_ids=ep.context, params=turn_params))
        self._turns[turn_id] = ep
        ep.is_parked = False
        return []

    def _on_turn(self, ep: _Episode, c: Completion) -> list[Completion]:
        """The turn's tokens join the episode, which parks while the environment steps."""
        ep.token_ids += c.token_ids
        ep.logprobs += c.logprobs
        ep.versions += c.policy_versions
        ep.mask += [1] * len(c.token_ids)
        ep.turns += 1
        ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        ep.is_parked = True
        self.pool.submit(EnvCall(ep.key, STEP, self.decode(ids)))
        return []

    def _finish(self, ep: _Episode, reason: str) -> EpisodeCompletion:
        del self._episodes[ep.key]
        if reason != "stop":
            self.pool.submit(EnvCall(ep.key, CLOSE))
        self.stats.episodes += 1
        self.stats.turns += ep.turns
        return EpisodeCompletion(
            request_id=ep.request.request_id,
            sample_index=ep.sample_index,
            prompt_ids=ep.prompt_ids,
            token_ids=ep.token_ids,
            logprobs=ep.logprobs,
            finish_reason=reason,
            policy_versions=ep.versions,
            policy_mask=ep.mask,
            reward=ep.reward,
            reward_info={**ep.info, "turns": float(ep.turns), "env_s": ep.env_s},
        )
