"""The scheduler's side of image encoding: a request stops short of an image whose rows
the runner does not hold and asks for it, the others' tokens go on meanwhile, a request
waiting at its first image never holds up the queue behind it, and the held rows are
dropped least recently used first, never those an unfinished request still needs."""

from llmserve.core.image_encodes import ImageEncodes
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmserve.core.request import Request, RequestStatus
from llmserve.core.scheduler import Scheduler, SchedulerConfig
from llmserve.multimodal.images import ImageInput
from llmserve.sampling_params import SamplingParams

TOKEN = 7


def make_scheduler(budget: int = 32, whole_images: bool = False) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget,
                                     whole_images=whole_images),
                     KVCacheManager(64, 4, False))


def make_request(request_id: str, num_tokens: int, *images: ImageInput) -> Request:
    request = Request(request_id, [100 + i for i in range(num_tokens)],
                      SamplingParams(max_tokens=16), 16)
    request.mm_inputs = list(images)
    return request


def step(scheduler: Scheduler, encoded: tuple[str, ...] = ()
         ) -> tuple[SchedulerOutput, dict[str, int]]:
    """One step; the runner finishes the images named. Returns the output and each
    scheduled request's number of tokens."""
    out = scheduler.schedule()
    result = ModelRunnerOutput.from_sampled(out, {
        s.request_id: [TOKEN] for s in out.scheduled if s.sample})
    result.encoded_images = list(encoded)
    scheduler.update(out, result)
    return out, {s.request_id: s.num_tokens for s in out.scheduled}


def test_a_request_stops_short_of_an_image_until_its_rows_are_ready():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("text", 6))
    image = ImageInput(None, "img", 5, 16)
    scheduler.add_request(make_request("image", 30, image))
    out, tokens = step(scheduler)
    assert tokens == {"text": 6, "image": 5}  # its text before the image
    assert out.encode_images == [image]
    for _ in range(3):  # the encode takes steps: the other request decodes meanwhile
        out, tokens = step(scheduler)
        assert tokens == {"text": 1} and out.encode_images == [image]
    assert scheduler.last_scheduled_ids == ["text", "image"]  # a failed encode fails it
    out, tokens = step(scheduler, encoded=("img",))  # finished during this step
    out, tokens = step(scheduler)
    assert tokens == {"text": 1, "image": 25} and out.encode_images == []


def test_a_request_waiting_at_its_first_image_holds_up_no_one_behind_it():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("image", 20, ImageInput(None, "img", 0, 16)))
    scheduler.add_request(make_request("text", 6))
    out, tokens = step(scheduler)
    assert tokens == {"text": 6}  # admitted behind the waiting one
    assert [r.request_id for r in scheduler.running] == ["image", "text"]
    assert [i.hash for i in out.encode_images] == ["img"]
    step(scheduler, encoded=("img",))
    _, tokens = step(scheduler)
    assert tokens == {"text": 1, "image": 20}


def test_the_same_image_is_asked_once_and_a_held_one_never():
    scheduler = make_scheduler()
    image = ImageInput(None, "same", 2, 8)
    scheduler.add_request(make_request("a", 12, image))
    scheduler.add_request(make_request("b", 12, image.placed(4, 8)))
    out, tokens = step(scheduler)
    assert tokens == {"a": 2, "b": 4} and [i.hash for i in out.encode_images] == ["same"]
    step(scheduler, encoded=("same",))
    scheduler.add_request(make_request("c", 12, image.placed(1, 8)))
    out, tokens = step(scheduler)
    assert tokens == {"a": 10, "b": 8, "c": 12} and out.encode_images == []


def test_an_aborted_requests_image_is_dropped_part_done():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("image", 20, ImageInput(None, "img", 4, 8)))
    out, _ = step(scheduler)
    assert [i.hash for i in out.encode_images] == ["img"]
    scheduler.finish_request("image", RequestStatus.FINISHED_ABORTED)
    out, _ = step(scheduler)
    assert out.encode_images == [] and out.drop_images == ["img"]


def test_held_rows_are_dropped_least_recently_used_never_those_still_needed():
    class Pending:  # an unfinished request that has yet to compute its image
        def __init__(self, *images: ImageInput) -> None:
            self.mm_inputs, self.num_computed_tokens = list(images), 0

    encodes = ImageEncodes(max_rows=20)
    images = {key: ImageInput(None, key, 0, 8) for key in "abcd"}
    for key in "abcd":
        assert not encodes.ready(images[key])
    encodes.update("abcd")
    assert encodes.ready(images["a"])  # used: now the most recent
    out = SchedulerOutput()
    encodes.finish_output(out, [Pending(images["b"])])
    # 32 rows held, 20 kept: c and d go (b is needed, a was used last)
    assert out.drop_images == ["c", "d"] and list(encodes.held) == ["b", "a"]


def test_a_chunk_never_ends_inside_an_image_that_attends_both_ways():
    """Up to the image when the chunk starts before it; the whole image (past the budget)
    when it starts at or inside it (a prefix hit may end inside one)."""
    scheduler = make_scheduler(budget=8, whole_images=True)
    request = make_request("r", 60, ImageInput(None, "a", 5, 16), ImageInput(None, "b", 30, 16))
    assert scheduler._chunk(request, 0, 8) == 5  # up to the image, asked for
    assert scheduler._chunk(request, 25, 8) == 5
    assert list(scheduler.images.asked) == ["a", "b"]
    scheduler.images.update(["a", "b"])  # ready now
    assert scheduler._chunk(request, 5, 8) == 16  # the whole image, past the budget
    assert scheduler._chunk(request, 9, 8) == 12  # from inside it (a prefix hit) to its end
    assert scheduler._chunk(request, 21, 8) == 8  # text only
    assert scheduler._chunk(request, 25, 8) == 5
    assert scheduler._chunk(request, 9, 0) == 0  # no budget left: nothing, not the image
    plain = make_scheduler(budget=8)
    assert plain._chunk(request, 0, 8) == 5  # not held: up to it
    plain.images.update(["a"])
    assert plain._chunk(request, 0, 8) == 8  # LLaVA's images may be split
