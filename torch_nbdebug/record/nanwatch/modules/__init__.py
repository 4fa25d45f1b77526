"""Module mode: module outputs and the gradients into them judged by one rule (``rule``)."""
