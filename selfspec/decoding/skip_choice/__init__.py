"""Skip strategies that choose the layer-skip draft's skip set while decoding (`skip_strategy=<name>`): SWIFT's
search from the context, CLaSp's dynamic programme over the verification's layer states, and a cost-aware knapsack
over sublayers. One module per idea; drafter.py is the drafter they share and the strategies they register."""
