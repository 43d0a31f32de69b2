"""Evaluation: data sets (generated math, HumanEval, ShareGPT), the length-inflation harness
(`runner`), its reports and plots (`report`), and the `acespec eval` command (`cli`)."""
