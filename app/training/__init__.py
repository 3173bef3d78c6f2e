"""Training jobs: one gradient step on submitted trajectory groups (`service`: accept and
show; `spec`: what a queued job stores; `runner`: train it, settle it)."""
