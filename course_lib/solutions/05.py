"""Chapter 05's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% ddp_token_weight
# hint: DDP averages the ranks' gradients: (w0·mean0 + w1·mean1) / 2 must equal (120·mean0 + 40·mean1) / 160, so w_r = N · n_r / Σn
ddp_token_weight = 2 * 120 / (120 + 40)

# %% no_sync_elements
# hint: without no_sync every micro-batch's backward all-reduces every gradient (R["params"] elements); with it only the last one does
no_sync_elements = {"sync_every": 8 * R["params"], "no_sync": R["params"]}

# %% buckets_at_1mb
# hint: sizes = [p.numel() for p in cl.models.tiny_qwen2(**P_ranks.model).parameters()]; walk them from the last to the first, add 4 bytes per element to the current bucket, close it once it holds >= bucket_cap_mb * 2**20 bytes; the rule gives len(B[str(float(P_ranks.bucket_mb))]["sizes"]) buckets at P_ranks.bucket_mb
sizes_ = [p.numel() for p in cl.models.tiny_qwen2(**P_ranks.model).parameters()]
buckets_, current_ = [], 0
for n_ in reversed(sizes_):
    current_ += n_
    if 4 * current_ >= 1 * 2**20:
        buckets_.append(current_)
        current_ = 0
buckets_at_1mb = len(buckets_) + (1 if current_ else 0)
