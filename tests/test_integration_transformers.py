"""Hugging Face transformers models generating through the real service, token for token.

Each model family gets its own service (a real coordinator and gRPC server on a loopback
port, in-process KV pools) whose layout fits it. The reference is the same weights running
transformers' own attention and DynamicCache.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

transformers = pytest.importorskip("transformers")

from cache_service.client import (  # noqa: E402
    AppendAttendItem,
    InvalidArgumentError,
    KVCacheClient,
    NotFoundError,
)
from cache_service.config import (  # noqa: E402
    LayoutConfig,
    MetricsConfig,
    ServerConfig,
    ServiceConfig,
    WorkersConfig,
)
from cache_service.integrations.embedded import EmbeddedService  # noqa: E402
from cache_service.integrations.transformers import (  # noqa: E402
    SERVICE_ATTENTION,
    ServiceModel,
    SessionConfig,
)

VOCAB = 96
PAD = VOCAB - 1  # never drawn as a prompt token, so any PAD on the wire is padding
NEW_TOKENS = 32
LOGIT_ATOL = 1e-4  # float32 model and float32 KV on both sides


@dataclass(frozen=True)
class Family:
    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def model(self, seed: int = 0) -> Any:
        torch.manual_seed(seed)
        common = dict(
            vocab_size=VOCAB,
            hidden_size=self.num_q_heads * self.head_dim,
            intermediate_size=96,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_q_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            pad_token_id=PAD,
            bos_token_id=None,
            eos_token_id=None,
            # Larger than the default 0.02 so the random model's logits are not near-ties.
            initializer_range=0.2,
            tie_word_embeddings=False,
        )
        if self.name == "llama":
            cfg = transformers.LlamaConfig(**common)
            model = transformers.LlamaForCausalLM(cfg)
        else:
            cfg = transformers.Qwen2Config(**common, use_sliding_window=False)
            model = transformers.Qwen2ForCausalLM(cfg)
        return model.eval()


LLAMA = Family("llama", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)  # GQA 2
QWEN2 = Family("qwen2", num_layers=3, num_q_heads=6, num_kv_heads=1, head_dim=8)  # MQA


class RecordingClient:
    """The real client, recording what each append_attend carried (seq, layer, token ids)."""

    def __init__(self, client: KVCacheClient) -> None:
        self._client = client
        self.appends: list[tuple[int, str, list[int]]] = []
        self.calls = {"items": 0, "batch": 0}  # append-and-attend calls by form

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def append_attend(self, layer: int, items: Sequence[AppendAttendItem]) -> list[Any]:
        self.appends.extend((layer, i.seq_id, list(i.token_ids)) for i in items)
        self.calls["items"] += 1
        return self._client.append_attend(layer, items)

    def append_attend_batch(
        self, layer: int, seq_ids: Sequence[str], token_ids: Any, *a: Any
    ) -> Any:
        self.appends.extend((layer, s, list(t)) for s, t in zip(seq_ids, token_ids, strict=True))
        self.calls["batch"] += 1
        return self._client.append_attend_batch(layer, seq_ids, token_ids, *a)

    def sent(self, seq_id: str, layer: int) -> list[int]:
        """Token ids sent for one sequence on one layer, in order."""
        return [t for (lay, s, ids) in self.appends if s == seq_id and lay == layer for t in ids]


def _service(family: Family) -> EmbeddedService:
    config = ServiceConfig(
        layout=LayoutConfig(
            num_layers=family.num_layers,
            num_kv_heads=family.num_kv_heads,
            head_dim=family.head_dim,
            block_size=16,
            dtype="float32",
        ),
        workers=WorkersConfig(num_workers=1, blocks_per_worker=256, in_process=True),
        server=ServerConfig(host="127.0.0.1", port=0),
        metrics=MetricsConfig(enabled=False),
        log_level="WARNING",
    )
    return EmbeddedService(config)


@pytest.fixture(scope="module", params=[LLAMA, QWEN2], ids=lambda f: f.name)
def family_service(request: pytest.FixtureRequest) -> Iterator[tuple[Family, EmbeddedService]]:
    with _service(request.param) as svc:
        yield request.param, svc


@pytest.fixture(scope="module")
def llama_service() -> Iterator[EmbeddedService]:
    with _service(LLAMA) as svc:
        yield svc


@pytest.fixture
def client(request: pytest.FixtureRequest) -> Iterator[RecordingClient]:
    svc = request.getfixturevalue(request.param)
    if isinstance(svc, tuple):
        svc = svc[1]
    with KVCacheClient(svc.address, timeout_s=30) as c:
        yield RecordingClient(c)


def _batch(lengths: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts: input_ids and attention_mask ``[len(lengths), max]``."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(0, PAD, (n,), generator=g)
        mask[b, width - n :] = 1
    return ids, mask


def _generate_kwargs() -> dict[str, Any]:
    return dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )


def _reference(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **_generate_kwargs())


def _assert_same_generation(ours: Any, ref: Any) -> None:
    assert torch.equal(ours.sequences, ref.sequences), (ours.sequences, ref.sequences)
    assert len(ours.logits) == len(ref.logits) == NEW_TOKENS
    worst = max((a - b).abs().max().item() for a, b in zip(ours.logits, ref.logits, strict=True))
    assert worst < LOGIT_ATOL, f"logits differ by up to {worst}"


@pytest.mark.parametrize(
    "lease_steps", [0, SessionConfig.lease_steps, 1, 5], ids=["calls", "leases", "1-step", "5-step"]
)
@pytest.mark.parametrize("client", ["family_service"], indirect=True)
def test_batched_greedy_generation_equals_transformers(
    family_service: tuple[Family, EmbeddedService], client: RecordingClient, lease_steps: int
) -> None:
    # Every layer as a call (the recording client sees each), or the default on a local
    # session: the service plans a forward (or up to `lease_steps` decode forwards) once
    # and every layer goes to the worker under the lease. Either way the tokens and logits
    # of transformers' own generation, the service holding every layer of every token,
    # and no lease outliving the session.
    leases = lease_steps > 0
    family, svc = family_service
    model = family.model(seed=1)
    reference = copy.deepcopy(model)
    lengths = [5, 19, 37, 12]
    ids, mask = _batch(lengths, seed=2)
    ref = _reference(reference, ids, mask)

    served = ServiceModel(model, client)
    assert model.config._attn_implementation == SERVICE_ATTENTION
    before = dict(client.calls)
    config = SessionConfig(reuse_prefix=False, step_leases=leases, lease_steps=max(lease_steps, 1))
    with served.session(ids, mask, config) as session, torch.no_grad():
        ours = session.generate(**_generate_kwargs())
        exported = [client.export_blocks(s).token_ids for s in session.seq_ids]
        seq_ids = session.seq_ids
    served.detach()
    _assert_same_generation(ours, ref)

    width = ids.shape[1]
    for b, n in enumerate(lengths):
        # The service holds exactly the row's real tokens: prompt without padding, then every
        # generated token but the last (generate never feeds that one back).
        real = ids[b, width - n :].tolist() + ours.sequences[b, width:-1].tolist()
        assert exported[b] == real
        if not leases:
            for layer in range(family.num_layers):
                assert client.sent(seq_ids[b], layer) == real
    assert session.stats.prefill_tokens == lengths
    assert session.stats.step_columns == [width] + [1] * (NEW_TOKENS - 1)
    decode_steps = NEW_TOKENS - 1
    if leases:
        # Every forward (the ragged prefill too) planned once and leased whole.
        assert client.calls == before
        assert session.stats.rpc_calls == 0
        assert session.stats.leased_calls == family.num_layers * NEW_TOKENS
        # The prefill's lease, then one per `lease_steps` decode forwards.
        assert session.stats.lease_forwards == NEW_TOKENS
        assert session.stats.leases == 1 + -(-decode_steps // lease_steps)
    else:
        # The ragged prefill item by item, every decode step as [batch, ...] tensors.
        assert client.calls["items"] - before["items"] == family.num_layers
        assert client.calls["batch"] - before["batch"] == family.num_layers * decode_steps
        assert session.stats.rpc_calls == family.num_layers * NEW_TOKENS
    assert len(svc.running.coordinator._leases) == 0
    assert client.stats().active_sequences == 0


@pytest.mark.parametrize("client", ["llama_service"], indirect=True)
def test_second_request_prefill_sends_only_the_uncached_suffix(client: RecordingClient) -> None:
    model = LLAMA.model(seed=3)
    reference = copy.deepcopy(model)
    served = ServiceModel(model, client)
    first, _ = _batch([40], seed=4)
    with torch.no_grad():
        served.generate(first, max_new_tokens=4, do_sample=False)

    # Shares 37 prompt tokens with the first request: two full 16-token blocks are cached.
    g = torch.Generator().manual_seed(5)
    second = torch.cat([first[:, :37], torch.randint(0, PAD, (1, 9), generator=g)], dim=1)
    assert client.lookup(second[0].tolist(), namespace=served.namespace) == 32
    assert client.lookup(second[0].tolist()) == 0  # cached in the model's namespace only
    ref = _reference(reference, second, torch.ones_like(second))
    client.appends.clear()
    # Every layer as a call, so the recording client sees what each layer sent.
    with (
        served.session(second, config=SessionConfig(step_leases=False)) as session,
        torch.no_grad(),
    ):
        ours = session.generate(**_generate_kwargs())
        seq_id = session.seq_ids[0]
    _assert_same_generation(ours, ref)
    assert session.stats.cached_tokens == [32]
    assert session.stats.prefill_tokens == [46 - 32]
    assert session.stats.step_columns[0] == 46 - 32  # the model computed only the suffix
    for layer in range(LLAMA.num_layers):
        first_append = next(ids for (lay, s, ids) in client.appends if s == seq_id and lay == layer)
        assert first_append == second[0, 32:].tolist()


@pytest.mark.parametrize("client", ["llama_service"], indirect=True)
def test_two_models_of_one_layout_never_share_cached_prefixes(client: RecordingClient) -> None:
    first_model, second_model = LLAMA.model(seed=11), LLAMA.model(seed=12)
    second_reference = copy.deepcopy(second_model)
    prompt, _ = _batch([40], seed=13)
    first = ServiceModel(first_model, client)
    with torch.no_grad():
        first.generate(prompt, max_new_tokens=2, do_sample=False)
    second = ServiceModel(second_model, client)
    assert second.namespace != first.namespace
    ref = _reference(second_reference, prompt, torch.ones_like(prompt))
    with second.session(prompt) as session, torch.no_grad():
        ours = session.generate(**_generate_kwargs())
    assert session.stats.cached_tokens == [0]  # the first model's K/V are not adopted
    _assert_same_generation(ours, ref)
    # The same weights in another ServiceModel (another process, say) find their prefix.
    again = ServiceModel(copy.deepcopy(second_reference), client)
    assert again.namespace == second.namespace
    assert client.lookup(prompt[0].tolist(), namespace=again.namespace) == 32
    named = ServiceModel(copy.deepcopy(second_reference), client, namespace="my-model")
    assert named.namespace == "my-model"


@pytest.mark.parametrize("client", ["family_service"], indirect=True)
def test_batched_prefix_hits_of_different_lengths_with_padding(
    family_service: tuple[Family, EmbeddedService], client: RecordingClient
) -> None:
    family, _ = family_service
    model = family.model(seed=6)
    reference = copy.deepcopy(model)
    served = ServiceModel(model, client)
    warm, _ = _batch([50], seed=7)
    with torch.no_grad():
        served.generate(warm, max_new_tokens=1, do_sample=False)

    # Row 0 shares 20 tokens (1 block cached), row 1 shares 40 (2 blocks), row 2 nothing.
    g = torch.Generator().manual_seed(8)
    prompts = [
        warm[0, :20].tolist() + torch.randint(0, PAD, (7,), generator=g).tolist(),
        warm[0, :40].tolist() + torch.randint(0, PAD, (3,), generator=g).tolist(),
        torch.randint(0, PAD, (11,), generator=g).tolist(),
    ]
    width = max(len(p) for p in prompts)
    ids = torch.full((3, width), PAD, dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    ref = _reference(reference, ids, mask)
    ours, stats = served.generate(ids, mask, **_generate_kwargs())
    _assert_same_generation(ours, ref)
    assert stats.cached_tokens == [16, 32, 0]
    assert stats.prefill_tokens == [len(p) - c for p, c in zip(prompts, [16, 32, 0], strict=True)]
    # The rows were created and freed (one call each), and the session says how long.
    assert stats.open_seconds > 0 and stats.close_seconds > 0


@pytest.mark.parametrize("client", ["llama_service"], indirect=True)
def test_bad_inputs_raise_and_change_nothing(client: RecordingClient) -> None:
    # A service whose layout does not fit the model: refused before the model is touched.
    qwen = QWEN2.model()
    with pytest.raises(ValueError, match="num_layers: service 2 != model 3"):
        ServiceModel(qwen, client)
    assert qwen.config._attn_implementation != SERVICE_ATTENTION

    model = LLAMA.model(seed=9)
    reference = copy.deepcopy(model)
    served = ServiceModel(model, client)
    with pytest.raises(ValueError, match="already routed"):
        ServiceModel(model, client)
    ids, mask = _batch([6, 9], seed=10)
    before = client.stats().active_sequences

    right_padded = mask.flip(1)
    with pytest.raises(ValueError, match="not left-padded"):
        served.session(ids.flip(1), right_padded)
    with pytest.raises(ValueError, match="no tokens"):
        served.session(ids, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="only 0"):
        served.session(ids, mask * 2)
    assert client.stats().active_sequences == before

    # A row's sequence that the service cannot create (here a prompt longer than the pool
    # holds, swapped in on the way): the rows go in one all-or-nothing call, so the session
    # is refused with that row's error and the service keeps none of the rows.
    real_create = client._client.create_sequences
    calls = []

    def create(prompts: Any, **kw: Any) -> Any:
        calls.append(len(prompts))
        prompts = [list(p) for p in prompts]
        prompts[2] = [1] * 5000
        return real_create(prompts, **kw)

    client.create_sequences = create
    try:
        with pytest.raises(InvalidArgumentError, match=r"sequences\[2\]: .*5000"):
            served.session(*_batch([6, 9, 7, 8], seed=11))
    finally:
        del client.create_sequences
    assert calls == [4] and client.stats().active_sequences == before

    # The routed model refuses to run without a session's cache.
    with pytest.raises(ValueError, match=r"past_key_values=session\.cache"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)

    with served.session(ids, mask) as session, torch.no_grad():
        assert client.stats().active_sequences == before + 2
        with pytest.raises(ValueError, match="set by the session"):
            session.generate(use_cache=False)
        other = ids.clone()
        other[1, -1] = (other[1, -1] + 1) % PAD
        with pytest.raises(ValueError, match="differ from the session's prompt"):
            model(input_ids=other, attention_mask=mask, past_key_values=session.cache)
        # Row 0 is left-padded by 3: its tokens sit at positions 0.., not at their columns.
        columns = torch.arange(ids.shape[1]).expand_as(ids)
        with pytest.raises(ValueError, match=r"row 0: position_ids \[3, 4, 5, 6, 7, 8\] do not"):
            model(
                input_ids=ids, attention_mask=mask, position_ids=columns,
                past_key_values=session.cache,
            )  # fmt: skip
        with pytest.raises(NotImplementedError, match="num_beams > 1"):
            session.generate(max_new_tokens=2, num_beams=2, do_sample=False)
        # None of that wrote anything: the session still generates exactly.
        assert session.stats.step_tokens == []
        ours = session.generate(**_generate_kwargs())
    _assert_same_generation(ours, _reference(reference, ids, mask))
    assert client.stats().active_sequences == before

    served.detach()
    assert model.config._attn_implementation == reference.config._attn_implementation
    with torch.no_grad():
        again = model.generate(input_ids=ids, attention_mask=mask, **_generate_kwargs())
    _assert_same_generation(again, _reference(reference, ids, mask))


@pytest.mark.parametrize("client", ["llama_service"], indirect=True)
def test_a_service_error_mid_step_surfaces_and_retires_the_session(client: RecordingClient) -> None:
    served = ServiceModel(LLAMA.model(seed=11), client)
    ids, mask = _batch([7, 4], seed=12)
    with served.session(ids, mask) as session, torch.no_grad():
        client.free(session.seq_ids[1])  # gone behind the session's back
        with pytest.raises(NotFoundError):
            session.generate(max_new_tokens=2, do_sample=False)
        # Layer 0 may have written some rows: the session refuses to go on.
        with pytest.raises(RuntimeError, match="unusable"):
            session.generate(max_new_tokens=2, do_sample=False)
    assert client.stats().active_sequences == 0


@pytest.mark.parametrize("client", ["llama_service"], indirect=True)
def test_a_forward_failing_before_its_first_layer_leaves_leases_working(
    client: RecordingClient,
) -> None:
    # The forward's lease request goes out when it begins; a forward that fails before
    # any attention layer reads the answer must still free the local session, so the
    # next session leases its steps.
    model = LLAMA.model(seed=13)
    served = ServiceModel(model, client)
    ids, mask = _batch([6, 9], seed=14)
    embed = model.get_input_embeddings()
    broken = torch.nn.Module()
    broken.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("embedding failed"))
    # The second time round the model's lease connection exists: a grant opens the lease
    # for it and sends the plan. A forward failing before its first layer reports that
    # lease as writing nothing: closing the session does not wait out the lease's timeout
    # (5 s) to revoke it, which would close the connection.
    connections = []
    for _ in range(2):
        model.set_input_embeddings(broken)
        with served.session(ids, mask) as session, torch.no_grad():
            with pytest.raises(RuntimeError, match="embedding failed"):
                session.generate(max_new_tokens=2, do_sample=False)
        model.set_input_embeddings(embed)
        with served.session(ids, mask) as session, torch.no_grad():
            session.generate(max_new_tokens=3, do_sample=False)
            # One lease for the prefill, one for both decode forwards.
            assert session.stats.leases == 2 and session.stats.lease_forwards == 3
            assert session.stats.rpc_calls == 0
        assert client.stats().active_sequences == 0
        connections.append(list(served.leaser._clients.values()))
    assert connections[0] == connections[1] and len(connections[0]) == 1


@pytest.mark.parametrize("client", ["llama_service"], indirect=True)
def test_a_generate_of_your_own_keeps_the_lease_until_released(client: RecordingClient) -> None:
    # model.generate(past_key_values=session.cache) run by the caller: the session holds
    # its decode lease between forwards and after the last; release_lease() gives it
    # back, committing every forward that ran, and the service then holds every token.
    model = LLAMA.model(seed=41)
    reference = copy.deepcopy(model)
    ids, mask = _batch([7, 4], seed=42)
    ref = _reference(reference, ids, mask)
    served = ServiceModel(model, client)
    with served.session(ids, mask, SessionConfig(lease_steps=64)) as session, torch.no_grad():
        ours = model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=session.cache, use_cache=True,
            **_generate_kwargs(),
        )  # fmt: skip
        # The prefill's lease and two for the 31 decode forwards (the service grants at
        # most coordinator.max_lease_steps, 16, each): the last still held.
        assert session.stats.leases == 3
        session.release_lease()
        session.release_lease()  # idempotent
        exported = [client.export_blocks(s).token_ids for s in session.seq_ids]
    served.detach()
    _assert_same_generation(ours, ref)
    width = ids.shape[1]
    for b, n in enumerate([7, 4]):
        assert exported[b] == ids[b, width - n :].tolist() + ours.sequences[b, width:-1].tolist()
    assert client.stats().active_sequences == 0
    with pytest.raises(ValueError, match="lease_steps"):
        SessionConfig(lease_steps=0)


@pytest.mark.parametrize("client", ["llama_service"], indirect=True)
def test_a_non_finite_decode_forward_ends_the_lease_and_keeps_what_came_before(
    client: RecordingClient,
) -> None:
    # The third decode forward's keys turn NaN on layer 1: the lease's layers there write
    # nothing (every layer after 0 sees NaN), the error reaches generate() (at the next
    # forward, which reads that forward's flags), the forwards before it stay committed
    # and the session is unusable.
    model = LLAMA.model(seed=43)
    served = ServiceModel(model, client)
    ids, mask = _batch([6, 3], seed=44)
    calls = {"n": 0}

    def poison(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return output * float("nan") if calls["n"] == 4 else output

    hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(poison)
    config = SessionConfig(free_on_close=False)
    try:
        with served.session(ids, mask, config) as session, torch.no_grad():
            with pytest.raises(InvalidArgumentError, match="non-finite inputs on layers 1"):
                session.generate(max_new_tokens=8, do_sample=False)
            with pytest.raises(RuntimeError, match="unusable"):
                session.generate(max_new_tokens=1, do_sample=False)
            seq_ids = session.seq_ids
    finally:
        hook.remove()
        served.detach()
    # Exporting waits for the lease (a call on its sequences ends it: what it wrote is
    # committed first); listing does not take the sequences' locks.
    exported = [client.export_blocks(s).token_ids for s in seq_ids]
    assert [len(t) for t in exported] == [6 + 2, 3 + 2]
    written = {e.seq_id: list(e.written) for e in client.list_sequences()}
    # The prefill and two decode forwards on every layer; the third on layer 0 only.
    assert written[seq_ids[0]] == [6 + 3] + [6 + 2] * (LLAMA.num_layers - 1)
    assert written[seq_ids[1]] == [3 + 3] + [3 + 2] * (LLAMA.num_layers - 1)
    for seq_id in seq_ids:
        client.free(seq_id)
    assert client.stats().active_sequences == 0
