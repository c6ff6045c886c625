"""The ladder below the Transformer: count bigram, Kneser–Ney n-gram, learned bigram, n-gram MLP."""
