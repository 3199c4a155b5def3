"""Drafter training (SpecForge recipe, REFERENCE 4): target-generated data, packed anchor blocks, export."""
