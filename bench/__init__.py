"""raysd's benchmarks: one entry point, `python -m bench` (bench.cli), one definition of every
figure (bench.measure), the scenarios in bench/scenarios/ (registered in bench.registry), results
in bench/results/, and docs/performance.md generated from them (bench.report)."""
