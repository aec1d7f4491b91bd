"""``kvfsm bench`` and everything it measures: the sections and their tables (:mod:`.suite`), the drain
(:mod:`.drain`), control-plane (:mod:`.control`), transfer (:mod:`.transfers`) and verification (:mod:`.verify`)
benchmarks and the seeded prefix-reuse workload generator (:mod:`.workload`).
"""
