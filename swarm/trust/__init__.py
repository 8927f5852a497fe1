"""Who may weigh in on training: the organizer's trust root, the trainers it vouches for, their receipts.

A swarm with a trust root (its public key in the swarm file) counts only work that a vouched trainer
assigned: every backward carries the trainer's signed receipt naming the peer it went to, and a
stage-mate's contribution to a round counts only the microbatches it holds receipts for. Without a
trust root, any member's word on what it holds is taken (see the README's note on open swarms).
"""
