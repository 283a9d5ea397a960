"""kvgate's benchmarks (`kvgate bench SCENARIO`) and load tests: a development kit the product never imports."""
