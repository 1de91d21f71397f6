"""CLaSp's layer choice (Chen et al., ACL 2025): which layers to skip, from the full model's layer states.

With h_0..h_L the full model's hidden states at the last verified token (h_i enters layer i), dp[i][j] is the best
state after layers 0..i-1 with j of them skipped: skipping layer i keeps the state, running it applies f_i. Running
every layer on every DP state would cost a forward per state, so, as CLaSp does, f_i is approximated from what the
verification already computed: f_i(x) ~ x + (h_{i+1} - h_i), the layer's own update in the full forward. Of the two
ways into dp[i+1][j], the one whose state is closer (cosine) to the full model's h_{i+1} wins; the answer is the
skip pattern of dp[L][budget]. Each state is h_0 plus the kept updates, so the DP runs over vectors in O(L * budget).
"""

import torch

from selfspec.decoding.skip_choice.capture import LayerStates


def clasp_skip_layers(states: LayerStates, budget: int) -> tuple[int, ...]:
    """The `budget` layers whose skipping keeps the final state closest to the full one (sorted layer ids)."""
    hidden = states.hidden  # (layers + 1, hidden)
    layers = hidden.shape[0] - 1
    budget = max(0, min(budget, layers))
    delta = hidden[1:] - hidden[:-1]  # (layers, hidden): each layer's update
    # row j: dp[i][j]'s state and skipped layers; j > i is unreachable (None)
    dp: list[tuple[torch.Tensor, tuple[int, ...]] | None] = [(hidden[0], ())] + [None] * budget
    for i in range(layers):
        new = [None] * (budget + 1)
        for j in range(min(i + 1, budget) + 1):
            options = []
            if dp[j] is not None and layers - i - 1 >= budget - j:  # run layer i (enough layers left to skip)
                options.append((dp[j][0] + delta[i], dp[j][1]))
            if j > 0 and dp[j - 1] is not None:  # skip layer i
                options.append((dp[j - 1][0], dp[j - 1][1] + (i,)))
            if options:
                new[j] = max(options, key=lambda option: float(torch.cosine_similarity(option[0], hidden[i + 1], 0)))
        dp = new
    return dp[budget][1]
