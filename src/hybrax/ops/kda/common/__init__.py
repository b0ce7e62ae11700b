"""What KDA's backends share beyond `base.py` (the problem, config and constants): stages of no one family.

    delta   the delta rule one token at a time: L2 norm of q and k, q/k per value head, one step
            S' = Diag(exp g) S + k (beta (v - S'^T k))^T, o = S^T q, and T = 1 ("xla:single_step", the decode
            kernels' gradient)
    layout  packed sequences in chunks, each sequence from a chunk boundary: `Segments` (whose chunk it is),
            `packed_layout`, and the gathers between tokens and padded rows (and their gradients)
"""
