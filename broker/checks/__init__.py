"""Spot checks: which work is replayed on another provider (verification), how a disagreement is
settled (disputes), and the verdicts applied."""
