"""Benchmark campaigns: single load points (bench), campaign files, matrix, runs, results, reports."""
