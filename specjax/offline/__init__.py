"""What is built before decoding, and its file formats: the Self-SD skip-set search,
FR-Spec token counts, DynaSpec's token clusters and router, and KNN-SSD's skip library.
Runtime drafters (`specjax.drafters`) read these artefacts; they never build them."""
