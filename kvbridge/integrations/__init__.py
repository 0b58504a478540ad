"""kvbridge."""
