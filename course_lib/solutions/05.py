"""Chapter 05's reference solutions (course_lib.exercises runs each block in the notebook; see README.md)."""

# %% ddp_token_weight
# hint: DDP averages the ranks' gradients, dividing their sum by N = 2; pick rank 0's weight so that the average equals the mean over all 160 target tokens
# mistake: 120 / (120 + 40) :: DDP divides the sum of the ranks' gradients by N = 2: the weight has to undo that division
# mistake: 1.0 :: the ranks hold different numbers of target tokens: equal weights over-count rank 1's tokens
ddp_token_weight = 2 * 120 / (120 + 40)

# %% no_sync_elements
# hint: count the gradient elements that go into all-reduce calls, not the bytes on the wire: without no_sync every micro-batch's backward all-reduces every gradient, with it only the last one does
# mistake: {"sync_every": R["params"], "no_sync": R["params"]} :: without no_sync each of the 8 micro-batches' backward all-reduces
# mistake: {"sync_every": 8 * R["params"], "no_sync": 0} :: with no_sync the last micro-batch still all-reduces (once)
no_sync_elements = {"sync_every": 8 * R["params"], "no_sync": R["params"]}

# %% buckets_at_2mib
# hint: DDP fills buckets in reverse order of model.parameters() (the order backward produces gradients), 4 bytes an fp32 element, and closes one once it holds at least bucket_cap_mb MiB (bucket_cap_mb × 2**20 bytes)
# mistake: buckets_by_(sizes_) :: DDP walks the parameters from the last to the first (the order backward produces their gradients)
# mistake: buckets_by_(sizes_[::-1], 2 * 2**20 / 2) :: fp32 gradients: 4 bytes an element
sizes_ = [p.numel() for p in cl.models.tiny_qwen2(**P_ranks.model).parameters()]

def buckets_by_(order, cap=2 * 2**20, bytes_per=4):
    count, current = 0, 0
    for n in order:
        current += n
        if bytes_per * current >= cap:
            count, current = count + 1, 0
    return count + (1 if current else 0)

buckets_at_2mib = buckets_by_(sizes_[::-1])
