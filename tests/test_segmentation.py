import torch

from engramkv.config import SegmentationConfig
from engramkv.memory.segmentation import OnlineSegmenter
from engramkv.memory.surprise import token_surprise


def _flat_with_spikes(n, spikes):
    s = torch.ones(n)
    s[::2] = 1.2  # a little variance so std > 0
    for t in spikes:
        s[t] = 10.0
    return s


def test_surprising_token_opens_an_event():
    seg = OnlineSegmenter(SegmentationConfig(min_event=4, max_event=1000), window=50)
    assert seg.push(_flat_with_spikes(100, [30, 70])) == [30, 70]


def test_min_event_merges_forward_and_max_event_splits():
    seg = OnlineSegmenter(SegmentationConfig(min_event=8, max_event=20), window=50)
    boundaries = seg.push(_flat_with_spikes(60, [10, 13]))
    assert 13 not in boundaries  # 3 tokens after the previous boundary: too short
    assert boundaries[0] == 10
    sizes = [b - a for a, b in zip([0] + boundaries, boundaries + [60])]
    assert max(sizes) <= 20 and min(sizes[:-1]) >= 8


def test_chunking_does_not_change_boundaries():
    surprise = torch.rand(500, generator=torch.Generator().manual_seed(2)) ** 4 * 10
    cfg = SegmentationConfig(min_event=8, max_event=64)
    whole = OnlineSegmenter(cfg, window=100).push(surprise)
    chunked_seg = OnlineSegmenter(cfg, window=100)
    chunked = [b for piece in surprise.split(37) for b in chunked_seg.push(piece)]
    assert whole == chunked and len(whole) > 5


def test_predicted_text_opens_no_event_however_flat_its_window():
    # Repeated filler: the model predicts every token (surprise ~0.01-0.05 nats), so the relative test
    # alone fires on noise; only the needle (6 nats) and the max_event cap may cut it.
    noise = torch.rand(400, generator=torch.Generator().manual_seed(0)) * 0.04 + 0.01
    noise[250] = 6.0
    unfloored = OnlineSegmenter(SegmentationConfig(min_event=8, max_event=128, min_surprise=0), window=100)
    assert len(unfloored.push(noise)) > 10
    floored = OnlineSegmenter(SegmentationConfig(min_event=8, max_event=128, min_surprise=1.0, predicted_event=None),
                              window=100)
    assert floored.push(noise) == [128, 250, 378]
    cadenced = OnlineSegmenter(SegmentationConfig(min_event=8, max_event=128, min_surprise=1.0, predicted_event=32),
                               window=100)
    # The needle's one token is an event of its own: the predicted run after it is cut off where it starts.
    assert cadenced.push(noise) == [32, 64, 96, 128, 160, 192, 224, 250, 251, 283, 315, 347, 379]


def test_a_predicted_run_leaves_the_event_it_followed_however_short():
    # A fact (6 surprising tokens, a cut at its first) then filler: the filler's run starts a new event once
    # it is `predicted_event` long, so the fact's event holds no filler, whatever min_event says.
    surprise = torch.rand(200, generator=torch.Generator().manual_seed(4)) * 0.04 + 0.01
    surprise[110:116] = torch.tensor([6.0, 3.0, 0.5, 4.0, 2.0, 5.0])
    cfg = SegmentationConfig(min_event=8, max_event=128, min_surprise=1.0, predicted_event=32)
    boundaries = OnlineSegmenter(cfg, window=100).push(surprise)
    assert boundaries == [32, 64, 96, 110, 116, 148, 180]
    chunked_seg = OnlineSegmenter(cfg, window=100)
    assert [b for piece in surprise.split(13) for b in chunked_seg.push(piece)] == boundaries


def test_a_restored_segmenter_cuts_predicted_text_where_an_uninterrupted_one_does():
    surprise = torch.rand(300, generator=torch.Generator().manual_seed(3)) * 0.5
    surprise[[20, 21, 150]] = 5.0
    cfg = SegmentationConfig(min_surprise=1.0, predicted_event=24)
    whole = OnlineSegmenter(cfg, window=100).push(surprise)
    first = OnlineSegmenter(cfg, window=100)
    cut = first.push(surprise[:140])
    for snapshot in (first.snapshot(), {k: v for k, v in first.snapshot().items() if k != "predicted_run"}):
        resumed = OnlineSegmenter(cfg, window=100)
        resumed.restore(snapshot)
        assert cut + resumed.push(surprise[140:]) == whole


def test_what_came_before_does_not_move_cuts_in_predicted_text():
    filler = torch.rand(300, generator=torch.Generator().manual_seed(1)) * 0.05
    filler[[40, 170]] = 4.0
    cfg = SegmentationConfig(min_surprise=1.0, predicted_event=32)
    cold = OnlineSegmenter(cfg, window=100, start=1000)
    warm = OnlineSegmenter(cfg, window=100, start=1000)
    warm.history.extend((torch.rand(100, generator=torch.Generator().manual_seed(2)) * 3).tolist())
    assert cold.push(filler) == warm.push(filler) == [1032, 1040, 1041, 1073, 1105, 1137, 1169, 1171, 1203, 1235,
                                                        1267, 1299]


def test_uniform_mode_ignores_surprise():
    seg = OnlineSegmenter(SegmentationConfig(mode="uniform", uniform_size=16), window=50, start=100)
    assert seg.push(_flat_with_spikes(64, [5, 33])) == [116, 132, 148]


def test_surprise_is_the_next_token_nll():
    logits = torch.randn(6, 11)
    ids = torch.randint(0, 11, (6,))
    previous = torch.randn(11)
    got = token_surprise(logits, ids, previous)
    predictors = torch.cat([previous[None], logits[:-1]])
    expected = -torch.log_softmax(predictors, -1)[torch.arange(6), ids]
    torch.testing.assert_close(got, expected)
    assert token_surprise(logits, ids, None)[0] == 0  # stream start


def test_a_one_token_stream_start_has_zero_surprise():
    # A stream may begin with a one-token step (a chat template's role marker, read on its own).
    assert token_surprise(torch.randn(1, 11), torch.tensor([3]), None).tolist() == [0.0]
