"""The job model of ``autotp estimate``: which tp x pp x dp to run a training job at, from the
plans the search makes. It reads the plan search (a plan, its collectives, what autograd
keeps) and the search never reads it.

    configure      the search over configurations: plan each tp once, profile, rank by step
                   time; what does not fit or cannot be built is refused with the reason
    profile        one rank's program in numbers: FLOPs, bytes moved, saved activations and
                   collectives per layer, at a micro-batch and sequence length
    memory         memory per GPU: model states, activations under a recomputation policy,
                   the peak; pipeline stages balanced (``balanced_stages``)
    timing         step time: compute, tp / ep / dp collectives, the pipeline bubble, the
                   optimizer step, over a (pp, dp, tp) ``MeshShape``
    hardware       what a GPU and its interconnect can do: presets, files, calibration
    expert_load    the expected load imbalance of experts held whole per rank
    estimate_view  the ranking as a table, JSON or an HTML page
"""
