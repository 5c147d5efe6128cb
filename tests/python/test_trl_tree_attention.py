"""deltasync.trl.sdpa_tree_attention, the CPU twin of TRL 1.16's FlashAttention-3 tree attention
(AsyncGRPOTrainer's training forward): samples packed into TRL's prefix trie (packing.TreeRow),
shared prompt forwarded once, give every sample the logits it gets alone with plain SDPA."""
import torch
from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow

import trl_tiny
from deltasync.trl.async_grpo import use_sdpa_tree_attention


def test_tree_packed_forward_matches_each_sample_alone():
    use_sdpa_tree_attention()
    tokenizer = trl_tiny.make_tokenizer()
    model = trl_tiny.make_model(tokenizer, dtype=torch.float32).eval()  # GQA: 4 query heads, 2 key heads
    prompt = [3, 4, 5, 6, 7]
    samples = [prompt + [8, 9, 10], prompt + [8, 11], prompt + [12, 3, 4, 5, 6], [9, 8, 7]]  # shared, forked, alone
    row = TreeRow()
    for i, ids in enumerate(samples):
        row.add({"input_ids": torch.tensor(ids), "completion_mask": torch.ones(len(ids), dtype=torch.long),
                 "old_log_probs": torch.zeros(len(ids)), "advantage": 0.0, "group_id": i})
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(map(len, samples))  # the prompt is forwarded once
    max_q, max_k = packed["tree_max_seqlens"].tolist()
    with torch.no_grad():
        model.config._attn_implementation = TREE_ATTENTION
        tree = model(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
                     tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
                     tree_cu_seqlens_k=packed["tree_cu_seqlens_k"], tree_max_seqlen_q=max_q,
                     tree_max_seqlen_k=max_k).logits[0]
        model.config._attn_implementation = "sdpa"
        for i, ids in enumerate(samples):
            alone = model(input_ids=torch.tensor([ids])).logits[0, :-1]  # the predictions of tokens 1..
            at = packed["token_index"][packed["segment_id"] == i]
            torch.testing.assert_close(tree[at], alone, rtol=1e-5, atol=1e-5, msg=f"sample {i}")
